"""The chaos soak: pelt as deployed (PostgreSQL, the MLflow server, a Ray head, two Ray worker hosts, the
API and two dispatchers) on hosts that talk over a network, a sweep of small jobs, and faults injected
while it runs; then the tool checks that nothing was lost and nothing done twice.

    sudo .venv/bin/python benchmarks/soak.py                       # 200 jobs, every fault kind twice
    sudo .venv/bin/python benchmarks/soak.py --jobs 30 --faults-per-kind 1 --json soak.json

Hosts (`soak_hosts.Network`: one network namespace each, on a bridge no other interface reaches):
`db` (PostgreSQL, the MLflow server, Redis for the Ray head's GCS), `api` (a Ray node with no CPUs, `pelt serve --no-dispatcher`, two
`pelt dispatcher --handover`, one leading and one standing by), `head` (the Ray head, no CPUs), `w1` and
`w2` (Ray worker nodes, one CPU each), and `client` (this tool: it submits, polls and checks through the
API as a user would, and reads the registry and MLflow directly for the checks). Every pelt, Ray and MLflow
process runs as uid 10001, as in pelt's image; PostgreSQL as `postgres`. A supervisor restarts what exits
on its own (as `restart: unless-stopped` would), and counts it.

Faults, at random moments while jobs run (`FAULTS`): SIGKILL a pelt worker; SIGKILL the leading dispatcher
(the standby takes over; the killed one comes back as the new standby); cut a worker host's link for longer
than a lease and restore it; SIGKILL the second worker host's Ray node and start it again; SIGKILL the Ray
head and start it again (its GCS keeps the cluster's state in Redis on the `db` host, as KubeRay's GCS fault
tolerance does); restart PostgreSQL (a fast or an immediate shutdown); restart the MLflow server (SIGKILL);
restart the API; cut the `db` host off from every other for longer than a lease (a partition of the
database host: PostgreSQL, the MLflow server and the GCS's Redis out of reach at once) and restore it.

Checked at the end (`check`): every job ended once (succeeded, or failed with its error after its attempts;
none queued, running or cancelled) and no submitted sweep queued twice; exactly one result and one
`succeeded` event per succeeded job, none for the others; exactly one MLflow model version and one live run
per succeeded job, none for the others, none without a job; the `best` and `best-<method>` aliases as the
leaderboard says; every succeeded job's delta, pulled through the API, matching its recorded sha256.
The table: faults by kind, jobs, retries, lost, duplicated, wall time. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak_cluster import (
    HOSTS,
    LEASE_SECONDS,
    WORKER_HOSTS,
    Cluster,
    log,
    wait_until,
)
from soak_hosts import SERVICE_GID, SERVICE_UID, Network, need_root, private_mounts

METHODS = ("lora", "pfeiffer", "prefix", "bitfit", "unipelt")
HYPERPARAMETERS = {"max_steps": 60, "batch_size": 8}
TERMINAL = {"succeeded", "failed", "cancelled"}
SETTLE_WAIT_SECONDS = 90  # the checks are tried again this long while the store still settles the last jobs


# --- the faults -----------------------------------------------------------------------------------


class Faults:
    """The fault kinds the soak injects; each returns what it did (None: nothing to do now, try later)."""

    def __init__(self, cluster: Cluster, registry: Any, rng: random.Random) -> None:
        self.cluster, self.registry, self.rng = cluster, registry, rng
        self.injected: Counter[str] = Counter()
        self.takeover_seconds: list[float] = []

    def kill_worker(self) -> str | None:
        workers = [
            process
            for host in WORKER_HOSTS
            for process in self.cluster.services[f"ray-{host}"].members()
            if process.name().startswith("ray::PeltWorker") or "PeltWorker" in " ".join(process.cmdline()[:1])
        ]
        busy = [p for p in workers if ".run" in " ".join(p.cmdline()[:1])]  # Ray's title while run() runs
        if not workers:
            return None
        victim = self.rng.choice(busy or workers)
        victim.send_signal(signal.SIGKILL)
        return f"pid {victim.pid}"

    def kill_leader(self) -> str | None:
        leader = self.registry.leader("pelt")
        if leader is None:
            return None
        pid = int(leader.holder.split(":")[1])
        service = next(
            (
                s
                for n, s in self.cluster.services.items()
                if n.startswith("dispatcher") and s.alive() and s.pid == pid
            ),
            None,
        )
        if service is None:
            return None
        started = time.monotonic()
        self._restart(service.name, signal.SIGKILL)  # it comes back as the standby
        wait_until(
            lambda: (now := self.registry.leader("pelt")) is not None and now.holder != leader.holder,
            120,
            "the standby to take over",
        )
        self.takeover_seconds.append(time.monotonic() - started)
        return f"{service.name}, standby led after {self.takeover_seconds[-1]:.1f} s"

    def cut_link(self) -> str:
        host = self.rng.choice(WORKER_HOSTS)
        return f"{host} cut for {self._cut(host):.0f} s"

    def _cut(self, host: str) -> float:
        """Cut the host's link for longer than a lease; restored whatever happens meanwhile (an interrupt)."""
        seconds = LEASE_SECONDS + 5
        self.cluster.net.link(host, up=False)
        try:
            time.sleep(seconds)
        finally:
            self.cluster.net.link(host, up=True)
        return seconds

    def cut_database_host(self) -> str:
        """A partition of the `db` host (PostgreSQL, the MLflow server, the GCS's Redis) from every other
        for longer than a lease: connections in flight stall (no reset reaches them), new ones time out."""
        seconds = self._cut("db")
        try:  # the cut happened: it counts, however long the services take to answer again
            self.cluster.wait_postgres()
            self.cluster.wait_mlflow()
        except Exception as exc:
            return f"db cut for {seconds:.0f} s; then {type(exc).__name__}: {exc}"
        return f"db cut for {seconds:.0f} s"

    def _restart(self, name: str, sig: signal.Signals, pause: float = 0.0, between: Any = None) -> None:
        """Stop a service with `sig` (SIGKILL for what is left after a while), `between()` if given, and
        start it again after `pause` s; the supervisor leaves it alone meanwhile."""
        service = self.cluster.services[name]
        with self.cluster.holding(name):
            service.stop(sig)
            if between is not None:
                between()
            time.sleep(pause)
            service.start()

    def restart_worker_host(self) -> str:
        self._restart("ray-w2", signal.SIGKILL, pause=2)
        self.cluster.wait_ray_node("ray-w2")
        return "ray-w2 killed and started"

    def restart_ray_head(self) -> str:
        # as a new head pod would: no record of the last cluster (`ray start --head` would take the other
        # hosts' processes, which it sees here, for a head still running at its address)
        record = self.cluster.work / "ray" / "ray-head" / "ray_current_cluster"
        self._restart("ray-head", signal.SIGKILL, pause=2, between=lambda: record.unlink(missing_ok=True))
        self.cluster.wait_ray_node("ray-head")
        return "SIGKILL and start (its GCS state in Redis)"

    def restart_postgres(self) -> str:
        service = self.cluster.services["postgres"]
        mode, sig = self.rng.choice([("fast", signal.SIGINT), ("immediate", signal.SIGQUIT)])
        with self.cluster.holding(service.name):
            assert service.process is not None
            service.process.send_signal(sig)  # the postmaster alone: it stops its children itself
            service.process.wait(timeout=120)
            service.stop(signal.SIGKILL)
            service.start()
        self.cluster.wait_postgres()
        return f"{mode} shutdown"

    def restart_mlflow(self) -> str:
        self._restart("mlflow", signal.SIGKILL)
        self.cluster.wait_mlflow()
        return "SIGKILL and start"

    def restart_api(self) -> str:
        self._restart("api", signal.SIGTERM)
        self.cluster.wait_api()
        return "SIGTERM and start"


FAULTS = {
    "kill worker": Faults.kill_worker,
    "kill dispatcher leader": Faults.kill_leader,
    "cut worker link": Faults.cut_link,
    "restart worker host": Faults.restart_worker_host,
    "restart Ray head": Faults.restart_ray_head,
    "restart PostgreSQL": Faults.restart_postgres,
    "restart MLflow": Faults.restart_mlflow,
    "restart API": Faults.restart_api,
    "cut database host": Faults.cut_database_host,
}


# --- the workload ---------------------------------------------------------------------------------


def toy_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """Sentences of random words ending in a positive or a negative pair of words (the label)."""
    from pelt_core.testing import VOCAB

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        label = rng.randint(0, 1)
        cue = rng.choice(["good great", "great fun"] if label else ["bad awful", "boring bad"])
        words = " ".join(rng.choice(VOCAB[5:100]) for _ in range(5))
        rows.append({"sentence": f"{words} {cue}", "label": label})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def prepare(cluster: Cluster, client: Any, tasks: int) -> list[str]:
    """The tiny backbone and the toy tasks registered through the API; returns the task names."""
    import torch
    from transformers import BertModel

    from pelt_core.testing import tiny_bert_config, tiny_tokenizer

    folder = cluster.work / "backbones" / "tiny-bert"
    torch.manual_seed(0)
    BertModel(tiny_bert_config()).eval().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    for path in [folder, *folder.rglob("*")]:
        os.chown(path, SERVICE_UID, SERVICE_GID)
    client.register_backbone("tiny-bert", str(folder))
    data = cluster.work / "upload"
    data.mkdir()
    names = [f"toy{index}" for index in range(tasks)]
    for index, name in enumerate(names):
        client.register_task(
            name,
            write_jsonl(data / f"{name}-train.jsonl", toy_rows(160, seed=2 * index)),
            write_jsonl(data / f"{name}-validation.jsonl", toy_rows(40, seed=2 * index + 1)),
            text_fields=["sentence"],
            label_names=["negative", "positive"],
        )
    return names


def sweep_plan(jobs: int, tasks: list[str], sweeps_at_least: int) -> list[tuple[str, int, list[str]]]:
    """(task, seed, methods) of each sweep: the jobs are every method of one task and one seed, then the
    next task or seed, cut into sweeps of at most five methods and, where `jobs` allow, at least
    `sweeps_at_least` sweeps (one to release before each fault)."""
    per_sweep = max(1, min(len(METHODS), jobs // max(1, sweeps_at_least)))
    plan: list[tuple[str, int, list[str]]] = []
    for first in range(0, jobs, len(METHODS)):
        group = first // len(METHODS)
        task, seed = tasks[group % len(tasks)], group // len(tasks)
        methods = list(METHODS)[: jobs - first]
        plan += [(task, seed, methods[at : at + per_sweep]) for at in range(0, len(methods), per_sweep)]
    return plan


class Submitter(threading.Thread):
    """Submits the sweeps of `sweep_plan`, as many as `release` allowed so far; each with its own
    idempotency key, tried again (with the same key) while the service is away. `sweep_ids`: what the API
    answered."""

    def __init__(self, client: Any, tasks: list[str], jobs: int, run: str, sweeps_at_least: int = 1) -> None:
        super().__init__(name="submitter", daemon=True)
        self.client, self.run_id = client, run
        self.plan = sweep_plan(jobs, tasks, sweeps_at_least)
        self.sweeps = len(self.plan)
        self.sweep_ids: list[int] = []
        self._allowed = 0
        self._changed = threading.Condition()
        self.stop = threading.Event()

    def release(self, sweeps: int) -> None:
        with self._changed:
            self._allowed = min(self.sweeps, self._allowed + sweeps)
            self._changed.notify_all()

    def run(self) -> None:
        for index in range(self.sweeps):
            with self._changed:
                self._changed.wait_for(lambda index=index: index < self._allowed or self.stop.is_set())
            task, seed, methods = self.plan[index]
            while not self.stop.is_set():
                try:
                    sweep = self.client.sweep(
                        task,
                        methods,
                        backbone="tiny-bert",
                        seeds=[seed],
                        hyperparameters=HYPERPARAMETERS,
                        idempotency_key=f"soak-{self.run_id}-{index}",
                    )
                    self.sweep_ids.append(sweep.id)
                    break
                except Exception as exc:  # the client's own retries ran out: the service is away for longer
                    log(
                        f"sweep {index}: {type(exc).__name__}: {str(exc)[:200]}; trying again with the same key"
                    )
                    self.stop.wait(2)


# --- the checks -----------------------------------------------------------------------------------


def every_page(search: Callable[..., Any], *args: Any) -> list[Any]:
    """Every item of an MLflow search, page after page (live runs only: deleted ones are gone)."""
    items: list[Any] = []
    token = None
    while True:
        page = search(*args, max_results=1000, page_token=token)
        items.extend(page)
        token = page.token
        if not token:
            return items


def check(
    cluster: Cluster, client: Any, registry: Any, expected_jobs: int, sweep_ids: list[int]
) -> dict[str, Any]:
    """Every invariant of the module docstring; returns counts and the list of problems found."""
    from mlflow import MlflowClient

    from pelt_core.delta_format import DELTA_FILE, sha256_file

    problems: list[str] = []
    jobs = client.jobs(limit=None)
    statuses = Counter(job.status for job in jobs)
    if len(jobs) != expected_jobs:
        problems.append(f"{len(jobs)} jobs in the registry, {expected_jobs} submitted")
    if len(set(sweep_ids)) != len(sweep_ids):
        problems.append(f"a sweep was queued twice: {sweep_ids}")
    unfinished = [job.id for job in jobs if job.status not in TERMINAL]
    lost = len(unfinished) + statuses["cancelled"]
    if unfinished:
        problems.append(f"jobs not ended: {unfinished}")
    failed_silently = [job.id for job in jobs if job.status == "failed" and not job.last_error]
    if failed_silently:
        problems.append(f"failed jobs without their error: {failed_silently}")
    mlflow = MlflowClient(tracking_uri=cluster.mlflow_url, registry_uri=cluster.mlflow_url)
    succeeded = {job.id: job for job in jobs if job.status == "succeeded"}
    duplicated = 0
    versions: dict[int, list[Any]] = {}
    runs: dict[int, list[Any]] = {}
    for task in sorted({job.task for job in jobs}):
        for version in every_page(mlflow.search_model_versions, f"name='pelt.{task}'"):
            versions.setdefault(int(version.tags.get("pelt.job_id", -1)), []).append(version)
        experiment = mlflow.get_experiment_by_name(f"pelt/{task}")
        if experiment is not None:
            for run_ in every_page(mlflow.search_runs, [experiment.experiment_id]):
                runs.setdefault(int(run_.data.tags.get("pelt.job_id", -1)), []).append(run_)
    for job in jobs:
        want = 1 if job.id in succeeded else 0
        events = [e.to_status for e in client.events(job.id)].count("succeeded")
        result = registry.get_result(job.id)
        found = {
            "succeeded events": events,
            "results": int(result is not None),
            "MLflow versions": len(versions.get(job.id, [])),
            "MLflow runs": len(runs.get(job.id, [])),
        }
        wrong = {what: count for what, count in found.items() if count != want}
        if wrong:
            problems.append(f"job {job.id} ({job.status}): {wrong}, wanted {want} of each")
            duplicated += any(count > want for count in wrong.values())
            lost += job.id in succeeded and any(count < want for count in wrong.values())
        if result is not None and versions.get(job.id):
            number = versions[job.id][0].version
            if str(result.mlflow_model_version) != str(number):
                problems.append(
                    f"job {job.id}: result names version {result.mlflow_model_version}, MLflow has {number}"
                )
    orphans = {
        job_id: len(found)
        for job_id, found in {**versions, **runs}.items()
        if job_id not in {j.id for j in jobs}
    }
    if orphans:
        problems.append(f"MLflow versions or runs of no job: {orphans}")
    for task in sorted({job.task for job in jobs}):
        desired: dict[str, str] = {}
        for row in registry.leaderboard(task):
            result = registry.get_result(row.best_job_id)
            if result is not None and result.mlflow_model_version is not None:
                desired.setdefault(f"best-{row.method}", str(result.mlflow_model_version))
                desired.setdefault("best", str(result.mlflow_model_version))
        actual = {a: str(v) for a, v in (mlflow.get_registered_model(f"pelt.{task}").aliases or {}).items()}
        if actual != desired:
            problems.append(f"{task}: aliases {actual}, the leaderboard says {desired}")
    mismatched = 0
    pulled = cluster.work / "pulled"
    for job in succeeded.values():
        result = registry.get_result(job.id)
        folder = pulled / str(job.id)
        try:
            client.download(job.task, folder, version=result.mlflow_model_version)
            sha = sha256_file(folder / DELTA_FILE)
        except Exception as exc:
            sha = f"not pulled: {type(exc).__name__}: {exc}"
        if sha != result.delta_sha256:
            mismatched += 1
            problems.append(f"job {job.id}: pulled delta {sha[:80]}, recorded {result.delta_sha256}")
    return {
        "jobs": len(jobs),
        "statuses": dict(statuses),
        "retries": sum(max(job.attempts - 1, 0) for job in jobs),
        "lost": lost,
        "duplicated": duplicated,
        "pulled_mismatched": mismatched,
        "problems": problems,
    }


# --- the run --------------------------------------------------------------------------------------


def machine() -> str:
    name = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    flags = Path("/proc/cpuinfo").read_text()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} ({isa}{', AVX512-BF16' if 'avx512_bf16' in flags else ''}), {os.cpu_count()} CPUs"


def table(report: dict[str, Any]) -> str:
    lines = ["| fault | injected |", "|---|---|"]
    lines += [f"| {kind} | {count} |" for kind, count in report["faults"].items()]
    lines += [
        "",
        "| jobs | succeeded | failed | retries | lost | duplicated | restarts by the supervisor | wall |",
        "|---|---|---|---|---|---|---|---|",
        f"| {report['jobs']} | {report['statuses'].get('succeeded', 0)} | {report['statuses'].get('failed', 0)} "
        f"| {report['retries']} | {report['lost']} | {report['duplicated']} "
        f"| {sum(report['supervisor_restarts'].values())} | {report['wall_seconds']:.0f} s |",
    ]
    return "\n".join(lines)


def soak(args: argparse.Namespace) -> dict[str, Any]:
    from services.client import PeltClient
    from services.registry import Registry
    from services.settings import Settings

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="pelt-soak-", dir=args.work_root))
    work.chmod(0o755)
    net = Network(f"pelt-soak-{os.getpid()}")
    cluster: Cluster | None = None
    started = time.monotonic()
    report: dict[str, Any] = {"machine": machine(), "work": str(work)}
    try:
        net.create(HOSTS)
        net.enter("client")
        report["hosts"] = dict(net.hosts)
        cluster = Cluster(net, work, Path(sys.executable).parent, gcs_redis=args.gcs_redis)
        log(f"hosts {net.hosts}; logs in {work / 'logs'}")
        cluster.start()
        cluster.supervise()
        settings = Settings(client_retries=8, client_retry_seconds=120)
        client = PeltClient(cluster.api_url, cluster.api_token, settings=settings, timeout=60)
        registry = Registry(cluster.db_url, check_schema=False)
        tasks = prepare(cluster, client, args.tasks)
        report["users"] = users = cluster.users()
        wrong_users = {
            name: ids for name, ids in users.items() if ids != [SERVICE_UID] and name != "postgres"
        }
        if wrong_users:
            raise RuntimeError(f"services not running as uid {SERVICE_UID} only: {wrong_users}")
        log(
            f"started in {time.monotonic() - started:.0f} s; submitting {args.jobs} jobs over {len(tasks)} tasks"
        )
        soak_started = time.monotonic()
        kinds = args.only or list(FAULTS)
        planned = [kind for kind in kinds for _ in range(args.faults_per_kind)]
        rng.shuffle(planned)
        submitter = Submitter(
            client, tasks, args.jobs, secrets.token_hex(4), sweeps_at_least=len(planned) + 1
        )
        submitter.start()
        chunk = max(1, submitter.sweeps // (len(planned) + 1))  # a share of the sweeps before each fault
        faults = Faults(cluster, registry, rng)
        deadline = soak_started + args.max_minutes * 60
        while planned and time.monotonic() < deadline:
            submitter.release(chunk)
            with contextlib.suppress(TimeoutError):  # jobs run while the fault strikes
                wait_until(lambda: client.jobs(status="running", limit=1), 30, "a running job")
            time.sleep(rng.uniform(0.5, args.fault_delay))
            kind = planned[0]
            try:
                did = FAULTS[kind](faults)
            except Exception as exc:
                did = None
                log(f"fault {kind} could not be injected now: {type(exc).__name__}: {exc}")
            if did is None:
                continue
            planned.pop(0)
            faults.injected[kind] += 1
            log(f"fault: {kind}: {did}")
        submitter.release(submitter.sweeps)
        submitter.join(max(0.0, deadline - time.monotonic()))
        wait_until(
            lambda: (
                not submitter.is_alive() and all(job.status in TERMINAL for job in client.jobs(limit=None))
            ),
            max(1.0, deadline - time.monotonic()),
            "every job to end",
            every=2,
        )
        sweep_ids = submitter.sweep_ids
        wall = time.monotonic() - soak_started
        # the dispatcher settles the last jobs' deltas after they end (a failed settling on its next rounds)
        checked = check(cluster, client, registry, args.jobs, sweep_ids)
        settle_deadline = time.monotonic() + SETTLE_WAIT_SECONDS
        while checked["problems"] and time.monotonic() < settle_deadline:
            time.sleep(5)
            checked = check(cluster, client, registry, args.jobs, sweep_ids)
        report.update(checked)
        report.update(
            faults=dict(faults.injected),
            faults_missing=dict(Counter(planned)),
            takeover_seconds=faults.takeover_seconds,
            supervisor_restarts=dict(cluster.restarts),
            wall_seconds=wall,
        )
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        for name, service in (cluster.services if cluster else {}).items():
            print(f"--- {name} (last lines of {service.log}) ---\n{service.tail(25)}", file=sys.stderr)
        raise
    finally:
        report["stubborn_services"] = cluster.shutdown() if cluster else []
        net.destroy()
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200, help="jobs in the sweep (default 200)")
    parser.add_argument("--tasks", type=int, default=4, help="toy tasks the jobs spread over")
    parser.add_argument("--faults-per-kind", type=int, default=2)
    parser.add_argument(
        "--only", action="append", choices=list(FAULTS), help="this fault kind only (repeatable)"
    )
    parser.add_argument(
        "--fault-delay", type=float, default=4.0, help="most seconds from jobs running to the next fault"
    )
    parser.add_argument("--max-minutes", type=float, default=40.0, help="the soak gives up after this")
    parser.add_argument("--seed", type=int, default=None, help="of the faults' order and moments")
    parser.add_argument(
        "--no-gcs-redis",
        dest="gcs_redis",
        action="store_false",
        help="the Ray head without Redis (no GCS fault tolerance): what a head restart costs then",
    )
    parser.add_argument("--json", help="write the report here")
    parser.add_argument(
        "--work-root", default="/tmp", help="where the run's folder goes (short: Ray's sockets)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run's folder (logs, data)")
    args = parser.parse_args(argv)
    need_root()
    if shutil.which("redis-server") is None:
        raise SystemExit(
            "the soak runs Redis for the Ray head's GCS: install redis-server (apt install redis-server)"
        )
    private_mounts()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the services and remove the hosts
    report = soak(args)
    print(table(report))
    for problem in report["problems"]:
        print(f"PROBLEM: {problem}")
    missing = report["faults_missing"]
    if missing:
        print(f"PROBLEM: faults not injected: {missing}")
    print(f"machine: {report['machine']}")
    return 1 if report["problems"] or missing or report["lost"] or report["duplicated"] else 0


if __name__ == "__main__":
    sys.exit(main())
