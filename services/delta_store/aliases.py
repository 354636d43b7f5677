"""The delta store's aliases: `best` and `best-<method>` as a projection of the registry's leaderboard,
and the rules for the aliases a caller may set.

An archived version (`archive_version`, an admin's) loses its aliases and never gets one back from a sync:
its job is left out of the leaderboard the aliases follow, so the best of the other runs takes `best` and
its method's `best-<method>`.

Aliases are never written from a worker's own view: `sync_aliases(task)` reads the registry's leaderboard
after the result row has committed, points `best` at the best run of the leaderboard's top row (the
configuration with the best mean over seeds) and `best-<method>` at the best run of that method's top row
(ties: fewer trainable parameters, then the older job: an alias moves only when a new result beats the
current one), then reads again and repeats until what it read is what it wrote, so concurrent syncs
converge on the last committed state. It is idempotent: a crash between the result row and the alias move
is repaired by any later sync (the next completion on the task, `reconcile(task)` at start-up).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from services.delta_store.base import StoreBase, ignore_missing, log
from services.delta_store.errors import DeltaNotFoundError, DeltaStoreError
from services.delta_store.values import (
    ALIAS_PATTERN,
    BEST,
    METHOD_ALIAS_PREFIX,
    TAG_ARCHIVED,
    VersionInfo,
    method_alias,
    version_string,
    version_uri,
)

if TYPE_CHECKING:
    from services.registry import Registry


class AliasMixin(StoreBase):
    """`sync_aliases`: the registry's best results as MLflow aliases."""

    def sync_aliases(
        self, task: str, registry: Registry | None = None, max_rounds: int = 5
    ) -> dict[str, str]:
        """Point `best` and `best-<method>` at the versions of the registry's best results for the task
        (only results stored in this store count); returns {alias: version}. Idempotent (module docstring)."""
        from services.registry import UnknownTaskError

        registry = self._registry(registry)
        model = self.model_name(task)
        desired: dict[str, str] = {}
        for _ in range(max_rounds):
            try:
                desired = self._desired_aliases(task, registry)
            except UnknownTaskError:
                return {}  # not a registry task (e.g. only composed versions): no best aliases
            try:
                current = self._best_aliases(model)
            except DeltaNotFoundError:
                if not desired:
                    return {}
                raise
            if current == desired:
                return desired
            for alias, version in desired.items():
                if current.get(alias) != version:
                    self.client.set_registered_model_alias(model, alias, version)
            for alias in current.keys() - desired.keys():
                with ignore_missing():
                    self.client.delete_registered_model_alias(model, alias)
        log.warning("aliases of %s kept changing while they were synced; last set to %s", task, desired)
        return desired

    def archive_version(
        self,
        task: str,
        version: str | int,
        *,
        registry: Registry | None = None,
        on_written: Callable[[VersionInfo], None] | None = None,
    ) -> VersionInfo:
        """Archive one version of a task: tagged archived, its aliases removed (best and best-<method> move
        to the best of the other versions when the store has a registry), so no pull by name or alias
        answers with it again; its number still pulls it. on_written: called once it is archived (the
        service records its audit event there); if it raises, the version is as it was. Archiving an
        archived version changes nothing and calls nothing."""
        model = self.model_name(task)
        number = version_string(version)
        info = self.get_version(f"{task}/{number}")
        if info.archived:
            return info
        self.client.set_model_version_tag(model, number, TAG_ARCHIVED, "true")
        removed = list(info.aliases)
        try:
            for alias in removed:
                with ignore_missing():
                    self.client.delete_registered_model_alias(model, alias)
            if on_written is not None:
                on_written(info)
        except BaseException:
            self.client.delete_model_version_tag(model, number, TAG_ARCHIVED)
            for alias in removed:
                self.client.set_registered_model_alias(model, alias, number)
            raise
        if removed and (registry or self.registry) is not None:
            self.sync_aliases(task, registry)
        return self.get_version(f"{task}/{number}")

    def _desired_aliases(self, task: str, registry: Registry) -> dict[str, str]:
        model = self.model_name(task)
        archived = self._archived_versions(model)
        left_out = [job_id for job_id in archived.values() if job_id is not None]
        rows = registry.leaderboard(task, exclude_job_ids=left_out)
        desired: dict[str, str] = {}
        for row in rows:  # the top row first: each alias names the best run of the first row it can
            version = self._recorded_version(registry, model, row.best_job_id)
            if version is None or version in archived:
                continue
            desired.setdefault(method_alias(row.method), version)
            desired.setdefault(BEST, version)
        return desired

    def _recorded_version(self, registry: Registry, model: str, job_id: int) -> str | None:
        """The version the registry recorded for a job, if it is one of this store's."""
        result = registry.get_result(job_id)
        if result is None or result.mlflow_model_version is None:
            return None
        if result.delta_uri is not None and result.delta_uri != version_uri(
            model, result.mlflow_model_version
        ):
            return None  # stored elsewhere (another store or namespace)
        return result.mlflow_model_version

    def _best_aliases(self, model: str) -> dict[str, str]:
        aliases = self._registered_model(model).aliases or {}
        return {a: str(v) for a, v in aliases.items() if a == BEST or a.startswith(METHOD_ALIAS_PREFIX)}


def check_alias(name: object, field: str) -> None:
    """An alias a caller may set: letters, digits, '_' and '-' (at most 100), not one MLflow reserves
    ("latest", v<digits>) and not one the registry's results set (best, best-<method>)."""
    if not isinstance(name, str) or not ALIAS_PATTERN.fullmatch(name):
        raise DeltaStoreError(
            f"{field}: {name!r} is not an alias: letters, digits, '_' and '-' (at most 100), "
            "and not 'latest' or v<digits> (MLflow's version references)",
            field=field,
        )
    if name == BEST or name.startswith(METHOD_ALIAS_PREFIX):
        raise DeltaStoreError(
            f"{field}: alias {name!r} is set by sync_aliases from the registry's results; "
            "give the composed version another alias",
            field=field,
        )
