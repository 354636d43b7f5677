"""The Registry's method searches: create one (every job of its first rung validated and queued in the same
transaction, or nothing), advance it (promote the best of a finished rung, or choose once the last rung
ended), cancel it, read it with its evidence.

A search's state is its rows (`Search`, `SearchTrial`): the schedule and configurations drawn at the start,
and one trial per job. `advance_search` is a pure function of those rows and the jobs' outcomes, written in
one transaction (a rung's jobs with their trials, or the answer), so calling it again, from a restarted
service or a second dispatcher, changes nothing twice: the unique (search, configuration, rung, seed) of a
trial refuses a second copy. The dispatcher calls `advance_searches` on a timer; nothing else is needed for
a search to run to its end. Rungs rank by the dev split of the study protocol (each job holds out
`dev_rows` training rows; the task's evaluation split is the test set, evaluated only by the last rung's
jobs, for the answer: the earlier rungs' jobs leave it out, `evaluate_test=false`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pelt_core.config import TrainConfig
from pelt_core.limits import SEED, TRAIN_RANGES
from pelt_core.spec import SIZE_ALIASES, module_kind, override_field
from services.registry import presets
from services.registry.actor import acting_as, current_actor
from services.registry.core import RegistryCore
from services.registry.errors import (
    IdempotencyConflictError,
    QuotaExceededError,
    RegistryValidationError,
)
from services.registry.models import (
    SEARCH_STATUSES,
    TERMINAL_STATUSES,
    ApiToken,
    Backbone,
    Job,
    JobStatus,
    Search,
    SearchTrial,
    Task,
)
from services.registry.rows import (
    audit,
    distinct_list,
    find_backbone,
    find_task,
    jsonable,
    queue_jobs,
    retry_once_on_conflict,
    submitted_by_current_actor,
)
from services.registry.search_plan import (
    ETA,
    FINAL_SEEDS,
    Configuration,
    Schedule,
    SearchPlanError,
    draw_configurations,
    method_space,
    plan_schedule,
    space_size,
    survivors,
)
from services.registry.search_rows import (
    SearchRecord,
    choose,
    dev_score,
    find_search,
    request_of,
    rung_running,
    search_record,
    trials_of,
)
from services.registry.task_data import held_out_rows
from services.registry.validation import check_int, check_key, check_name, check_range, split_hyperparameters

log = logging.getLogger("pelt.registry")

DEFAULT_SEARCH_METHODS = ("bitfit", "lora", "pfeiffer", "prefix", "unipelt")
DEFAULT_K = 500
DEFAULT_DEV_ROWS = 500
# training hyperparameters a search sets itself: each rung's epochs, the protocol's dev split, and whether
# a job evaluates the test set (only the last rung's: the earlier ones are ranked on dev, and their test
# evaluation cost as much as a short rung's training)
SEARCH_CONTROLLED = frozenset({"epochs", "max_steps", "dev_rows", "patience", "evaluate_test"})


class Searches(RegistryCore):
    """create_search, advance_search(es), cancel_search, get_search, list_searches: one part of `Registry`."""

    def create_search(
        self,
        task: str,
        budget: float,
        *,
        backbone: str,
        methods: Sequence[str] | None = None,
        k_shot: int | None = None,
        dev_rows: int | None = None,
        hyperparameters: Mapping[str, Any] | None = None,
        seeds: int = FINAL_SEEDS,
        seed: int = 0,
        idempotency_key: str | None = None,
    ) -> SearchRecord:
        """Plan a search and queue its first rung, or refuse it with an error naming what to change, having
        written nothing: a budget too small for one rung, an unknown method, a K or dev split the task
        cannot supply, hyperparameters a search sets itself, a space with nothing to search. `budget`:
        full-job equivalents (one job at the search's full epochs, `hyperparameters["epochs"]` or 3, on
        K rows). `k_shot` defaults to min(500, half the task's training rows), `dev_rows` to min(500, the
        rows left). The last rung runs `seeds` seeds of each survivor. The same token's idempotency key
        returns the search it made."""
        names = distinct_list(
            list(methods or DEFAULT_SEARCH_METHODS), "methods", lambda m, f: check_name(m, f)
        )
        fixed = dict(hyperparameters or {})
        train, _, given = split_hyperparameters(fixed)
        controlled = sorted(given[name] for name in SEARCH_CONTROLLED & set(train) if name != "epochs")
        if controlled:
            raise RegistryValidationError(
                controlled[0],
                "a search sets it itself (each rung's length, the protocol's dev split, which rung "
                "evaluates the test set)",
            )
        full_epochs = float(
            check_range(
                TRAIN_RANGES["epochs"], train.get("epochs", TrainConfig.epochs), given.get("epochs", "epochs")
            )
        )
        batch_size = check_range(
            TRAIN_RANGES["batch_size"],
            train.get("batch_size", TrainConfig.batch_size),
            given.get("batch_size", "batch_size"),
        )
        seeds = check_int(seeds, "seeds", minimum=2, maximum=10)
        seed = check_int(seed, "seed", minimum=int(SEED.low))
        if seed + seeds - 1 > SEED.high:
            raise RegistryValidationError(
                "seed",
                f"the last rung runs seeds {seed} to {seed + seeds - 1}: at most {int(SEED.high) - seeds + 1}",
            )
        key = check_key(idempotency_key)
        if not (isinstance(budget, int | float) and not isinstance(budget, bool)):
            raise RegistryValidationError(
                "budget", f"must be a number of full-job equivalents, got {budget!r}"
            )
        request = {
            "budget": float(budget),
            "methods": names,
            "k_shot": k_shot,
            "dev_rows": dev_rows,
            "hyperparameters": jsonable(fixed),
            "seeds": seeds,
            "seed": seed,
        }

        def write() -> SearchRecord:
            with self._writing() as session:
                now = self._now()
                task_row, backbone_row = find_task(session, task), find_backbone(session, backbone)
                if key is not None:
                    existing = session.scalar(
                        select(Search).where(
                            Search.idempotency_key == key, submitted_by_current_actor(Search)
                        )
                    )
                    if existing is not None:
                        if request_of(existing) != {
                            **request,
                            "task": task_row.id,
                            "backbone": backbone_row.id,
                        }:
                            raise IdempotencyConflictError(
                                key, f"search {existing.id} was made under this key for another request"
                            )
                        return search_record(session, existing)
                k, rows = _search_rows(task_row, k_shot, dev_rows)
                bases = {name: presets.job_method(session, name, now) for name in names}
                spaces = {name: method_space(bases[name].spec, fixed) for name in names}
                if space_size(spaces) < ETA:
                    raise RegistryValidationError(
                        "hyperparameters",
                        f"nothing to search: {', '.join(names)} with everything fixed hold fewer than {ETA} "
                        "configurations; give more methods or fix less",
                    )
                try:
                    schedule = plan_schedule(
                        budget,
                        full_epochs,
                        final_seeds=seeds,
                        max_configurations=space_size(spaces),
                        steps_per_epoch=-(-k // batch_size),
                    )
                except SearchPlanError as exc:
                    raise RegistryValidationError(exc.field, exc.message) from None
                first = schedule.rungs[0].configurations
                if first < len(names):
                    raise RegistryValidationError(
                        "budget",
                        f"{budget:g} full-job equivalents buy {first} configurations for {len(names)} methods: "
                        "some would never be tried; give a larger budget or fewer methods",
                    )
                largest = max(rung.configurations * rung.seeds for rung in schedule.rungs)
                if current_actor() is not None and largest > self.max_queued_jobs_per_token:
                    raise RegistryValidationError(
                        "budget",
                        f"its largest rung queues {largest} jobs; a token may have at most "
                        f"{self.max_queued_jobs_per_token} waiting (PELT_MAX_QUEUED_JOBS_PER_TOKEN)",
                    )
                configurations = draw_configurations(spaces, first, seed)
                search = Search(
                    task_id=task_row.id,
                    backbone_id=backbone_row.id,
                    status="running",
                    budget=float(budget),
                    k_shot=k,
                    dev_rows=rows,
                    seed=seed,
                    methods=names,
                    hyperparameters=jsonable(fixed),
                    schedule=schedule.to_dict() | {"request": {"k_shot": k_shot, "dev_rows": dev_rows}},
                    space={m: {key: d.describe() for key, d in space.items()} for m, space in spaces.items()},
                    configurations=[
                        {"index": c.index, "method": c.method, "hyperparameters": c.hyperparameters}
                        for c in configurations
                    ],
                    fingerprints={name: base.fingerprint for name, base in bases.items()},
                    idempotency_key=key,
                    submitted_by=current_actor(),
                    created_at=now,
                    updated_at=now,
                )
                session.add(search)
                session.flush()
                for rung in range(1, len(schedule.rungs)):  # every later rung's jobs would be valid too
                    self._plan_rung(session, search, task_row, backbone_row, rung, configurations, now)
                self._queue_rung(session, search, task_row, backbone_row, 0, configurations, now)
                audit(
                    session,
                    now,
                    "search.create",
                    f"search {search.id}",
                    {"task": task_row.name, "budget": float(budget), "configurations": len(configurations)},
                )
                return search_record(session, search)

        return retry_once_on_conflict(write)

    def get_search(self, search_id: int) -> SearchRecord:
        """The search with its trials and evidence (UnknownSearchError when there is none)."""
        with self._reading() as session:
            return search_record(session, find_search(session, search_id))

    def list_searches(
        self, *, task: str | None = None, status: str | None = None, limit: int = 100, offset: int = 0
    ) -> list[SearchRecord]:
        """Searches matching the filters, newest first."""
        check_int(limit, "limit", minimum=1, maximum=1000)
        check_int(offset, "offset", minimum=0)
        with self._reading() as session:
            query = select(Search)
            if task is not None:
                query = query.where(Search.task_id == find_task(session, task).id)
            if status is not None:
                if status not in SEARCH_STATUSES:
                    raise RegistryValidationError("status", f"must be one of {', '.join(SEARCH_STATUSES)}")
                query = query.where(Search.status == status)
            rows = session.scalars(query.order_by(Search.id.desc()).limit(limit).offset(offset))
            return [search_record(session, row) for row in rows]

    def cancel_search(self, search_id: int, *, own_only: bool = False) -> SearchRecord:
        """Stop a running search: it ends cancelled, and its queued jobs are cancelled (running ones are
        flagged and stop at their next heartbeat). An ended search is returned unchanged. `own_only`: as
        for `cancel_job` (a token without the admin scope cancels only its own searches)."""
        from services.registry.queue import _check_owner

        with self._writing() as session:
            search = find_search(session, search_id)
            owner = _check_owner(f"search {search_id}", search.submitted_by, own_only)
            if search.status == "running":
                now = self._now()
                search.status, search.finished_at, search.updated_at = "cancelled", now, now
                live = session.scalars(
                    select(Job)
                    .join(SearchTrial, SearchTrial.job_id == Job.id)
                    .where(
                        SearchTrial.search_id == search_id,
                        Job.status.in_([JobStatus.QUEUED.value, JobStatus.RUNNING.value]),
                    )
                    .with_for_update(of=Job)
                )
                cancelled = sum(
                    self._cancel(session, job, now, f"search {search_id} cancelled") for job in live
                )
                audit(session, now, "search.cancel", f"search {search_id}", {"jobs": cancelled, **owner})
            return search_record(session, search)

    def advance_searches(self) -> list[int]:
        """Advance every running search (`advance_search`), oldest first; returns the ids whose state
        changed. A search that cannot queue its next rung now (its token's queue is full) waits for the
        next call; one whose next rung can never be queued (refused as invalid) ends failed with the
        reason; any other error is logged and that search tried again on the next call, the others go on."""
        with self._reading() as session:
            running = list(
                session.scalars(select(Search.id).where(Search.status == "running").order_by(Search.id))
            )
        changed = []
        for search_id in running:
            try:
                if self.advance_search(search_id):
                    changed.append(search_id)
            except QuotaExceededError as exc:
                log.info("search %d waits for its next rung: %s", search_id, exc)
            except RegistryValidationError as exc:
                self._fail_search(search_id, f"its next rung was refused: {exc}")
                changed.append(search_id)
            except Exception:
                log.exception("search %d could not advance; trying again on the next round", search_id)
        return changed

    def advance_search(self, search_id: int) -> bool:
        """One step of a search, if its current rung has ended: queue the next rung (the best
        configurations by the dev metric, trained longer), or, after the last rung, choose the
        configuration with the best mean dev score over its seeds and end succeeded; fail it if a whole
        rung failed or a method's preset changed under it. Returns whether anything changed (False: still
        running its rung, or already ended)."""
        with self._reading() as session:  # the common case, a rung still training, takes no write turn
            search = find_search(session, search_id)
            if search.status != "running" or rung_running(session, search_id):
                return False

        def write() -> bool:
            with self._writing() as session:
                search = find_search(session, search_id, lock=True)
                if search.status != "running":
                    return False
                # the service acts here, not a caller: its audit events have no actor and name the owner;
                # the jobs it queues are the owner's (`_queue_rung`), counted against the owner's quota
                with acting_as(None):
                    return self._advance(session, search)

        return retry_once_on_conflict(write)

    def _fail_search(self, search_id: int, error: str) -> None:
        with self._writing() as session:
            search = find_search(session, search_id, lock=True)
            if search.status == "running":
                now = self._now()
                search.status, search.finished_at, search.updated_at = "failed", now, now
                search.last_error = error[:4000]
                audit(
                    session, now, "search.fail", f"search {search_id}", {"submitted_by": search.submitted_by}
                )

    # --- the steps ---------------------------------------------------------------------------------

    def _advance(self, session: Session, search: Search) -> bool:
        schedule = Schedule.from_dict(search.schedule)
        trials = trials_of(session, search.id)
        rung = max(trial.rung for trial, _ in trials)
        current = [(trial, job) for trial, job in trials if trial.rung == rung]
        if any(job.status not in TERMINAL_STATUSES for _, job in current):
            return False
        now = self._now()
        changed = [
            name
            for name, version in (search.fingerprints or {}).items()
            if presets.job_method(session, name, now).fingerprint != version
        ]
        if changed:
            search.status, search.finished_at, search.updated_at = "failed", now, now
            search.last_error = (
                f"the preset of {', '.join(changed)} changed during the search (its rungs would compare "
                "different methods); start a new search"
            )
            audit(
                session,
                now,
                "search.fail",
                f"search {search.id}",
                {"on_behalf_of": search.submitted_by, "changed": changed},
            )
            return True
        direction = search.task.metric_direction
        values = [(trial.configuration, dev_score(job)) for trial, job in current]
        if all(value is None for _, value in values):
            errors = sorted({job.last_error or job.status for _, job in current})
            search.status, search.finished_at, search.updated_at = "failed", now, now
            search.last_error = (
                f"every job of rung {rung} ended without a dev score: {'; '.join(errors)[:2000]}"
            )
            audit(
                session,
                now,
                "search.fail",
                f"search {search.id}",
                {"on_behalf_of": search.submitted_by, "rung": rung},
            )
            return True
        if rung < len(schedule.rungs) - 1:
            revoked = _revoked_at(session, search.submitted_by)
            if revoked is not None:
                search.status, search.finished_at, search.updated_at = "failed", now, now
                search.last_error = (
                    f"the token {search.submitted_by!r} that started it was revoked "
                    f"({revoked:%Y-%m-%d %H:%M} UTC): it queues no more jobs (rung {rung + 2} of "
                    f"{len(schedule.rungs)} was next); start a new search with a valid token"
                )
                audit(
                    session,
                    now,
                    "search.fail",
                    f"search {search.id}",
                    {"on_behalf_of": search.submitted_by, "reason": "token revoked"},
                )
                return True
            keep = schedule.rungs[rung + 1].configurations
            scored = [(index, value) for index, value in values if value is not None]
            promoted = survivors(scored, keep, direction)
            drawn = {c["index"]: c for c in search.configurations}
            chosen = [
                Configuration(index, drawn[index]["method"], dict(drawn[index]["hyperparameters"]))
                for index in promoted
            ]
            with acting_as(search.submitted_by):  # the owner's jobs, within the owner's quota
                self._queue_rung(session, search, search.task, search.backbone, rung + 1, chosen, now)
            search.updated_at = now
            audit(
                session,
                now,
                "search.rung",
                f"search {search.id}",
                {"on_behalf_of": search.submitted_by, "rung": rung + 1, "configurations": len(chosen)},
            )
            return True
        search.chosen = choose(search, current, direction)
        search.status, search.finished_at, search.updated_at = "succeeded", now, now
        audit(
            session,
            now,
            "search.succeed",
            f"search {search.id}",
            {"on_behalf_of": search.submitted_by, "chosen": search.chosen["configuration"]},
        )
        return True

    def _plan_rung(
        self,
        session: Session,
        search: Search,
        task: Task,
        backbone: Backbone,
        rung: int,
        configurations: Sequence[Configuration],
        now: datetime,
    ) -> list[tuple[int, Any]]:
        """The validated jobs of a rung (one per configuration; the last rung: one per seed), unwritten:
        [(configuration index, planned job)]. A fixed method-spec value applies to the methods that have
        its module (`r=8` does not reach BitFit)."""
        schedule = Schedule.from_dict(search.schedule)
        step = schedule.rungs[rung]
        seeds = [search.seed + offset for offset in range(step.seeds)]
        planned = []
        for configuration in configurations:
            spec = presets.job_method(session, configuration.method, now).spec
            values = {
                **_applicable(search.hyperparameters, spec),
                **configuration.hyperparameters,
                "epochs": step.epochs,
                "dev_rows": search.dev_rows,
                "evaluate_test": rung == len(schedule.rungs) - 1,  # earlier rungs are ranked on dev
            }
            split = split_hyperparameters(values)
            planned.extend(
                (configuration.index, plan)
                for plan in self._plan_method(
                    session, configuration.method, split, task, backbone, seeds, [search.k_shot], now
                )
            )
        return planned

    def _queue_rung(
        self,
        session: Session,
        search: Search,
        task: Task,
        backbone: Backbone,
        rung: int,
        configurations: Sequence[Configuration],
        now: datetime,
    ) -> None:
        """Validate and queue the jobs of a rung with their trials, in the caller's transaction."""
        planned = self._plan_rung(session, search, task, backbone, rung, configurations, now)
        self._check_queue_quota(session, len(planned))
        jobs = queue_jobs(
            session,
            [plan for _, plan in planned],
            task_id=task.id,
            backbone_id=backbone.id,
            priority=0,
            max_attempts=self.max_attempts,
            now=now,
            reason=f"search {search.id}, rung {rung}",
        )
        for (index, plan), job in zip(planned, jobs, strict=True):
            session.add(
                SearchTrial(
                    search_id=search.id, configuration=index, rung=rung, seed=plan.seed, job_id=job.id
                )
            )
        session.flush()


def _revoked_at(session: Session, token_name: str | None) -> datetime | None:
    """When the token named `token_name` was revoked (None: not revoked, or no token started the search)."""
    if token_name is None:
        return None
    return session.scalar(select(ApiToken.revoked_at).where(ApiToken.name == token_name))


def _applicable(fixed: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
    """The fixed hyperparameters that apply to a method: every training one, and the method-spec ones
    whose module it has (a size alias of a kind it has, `role.field` of a role it has, a bare module
    field when it has modules)."""
    modules = spec.get("modules") or {}
    kinds = {module_kind(module) for module in modules.values()}
    train, _, given = split_hyperparameters(fixed)
    training_keys = {given[name] for name in train}
    kept = {}
    for key, value in fixed.items():
        if key in training_keys:
            kept[key] = value
        elif key in SIZE_ALIASES:
            if SIZE_ALIASES[key] in kinds:
                kept[key] = value
        elif "." in key:
            if key.split(".", 1)[0] in modules:
                kept[key] = value
        elif override_field(key) in ("bias", "layer_norm") or modules:
            kept[key] = value
    return kept


def _search_rows(task: Task, k_shot: int | None, dev_rows: int | None) -> tuple[int, int]:
    """The search's K and dev rows, defaulted from and checked against the task's training rows."""
    available = task.train_size - held_out_rows(task.split_sizes, task.train_size)
    k = min(DEFAULT_K, available // 2) if k_shot is None else check_int(k_shot, "k_shot", minimum=1)
    if k < 1 or k >= available:
        raise RegistryValidationError(
            "k_shot",
            f"{k} leaves no dev rows: the task has {available} training rows for K and the dev split",
        )
    rows = (
        min(DEFAULT_DEV_ROWS, available - k)
        if dev_rows is None
        else check_int(dev_rows, "dev_rows", minimum=1)
    )
    if k + rows > available:
        raise RegistryValidationError(
            "dev_rows",
            f"K={k} and {rows} dev rows need {k + rows} training rows; the task has {available}",
        )
    return k, rows


__all__ = ["DEFAULT_SEARCH_METHODS", "Searches"]
