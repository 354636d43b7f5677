"""The Ray and worker side against a local user and an oversized job (issue "Harden, second round").

- The local Ray that pelt starts keeps its session folders (Unix sockets, logs, spilled objects) to its
  user: they sit in a folder only that user may enter, and neither the session folder nor any folder under
  it has group or other permissions, also after a task ran (Ray makes them 0777 in /tmp/ray by itself).
- A job's memory budget (PELT_WORKER_MEMORY_BYTES) is the machine's memory by default, not a constant: the
  least of physical memory, the cgroup's limit and RLIMIT_AS; an explicit value still wins. A job estimated
  above it is refused at submission, and a worker whose own budget is lower than the API host's fails the
  job it takes, before reading its data or mapping its backbone, with the reason, and without a retry.
- pelt reaches Ray through its public means only (documented environment variables, `ray.init` options):
  nothing of `ray._private`; a process that imported `ray` before pelt could turn token authentication on
  is refused instead of silently running without it.

Ray starts once, in a child process (a fresh `ray` import, as in `pelt serve`); the budget under an
address-space limit is read in a child process under RLIMIT_AS, as the first round's tests do.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import Api
from tests.api.helpers import refused
from tests.security.fakes import Lease

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
ADDRESS_SPACE_LIMIT = 3 * GIB  # enough to import torch and train the tiny model; below a 4.3 GiB estimate
TINY_FACTS = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 4,
    "head_dim": 8,
    "intermediate_size": 64,
    "max_positions": 64,
    "vocab_size": 114,
}


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment without Ray's and pelt's variables (the child's answers must not come
    from them: pelt sets Ray's itself before it imports ray), plus `extra`."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("RAY_", "PELT_"))}
    env.update(extra)
    return env


def run_child(code: str, env: dict[str, str], timeout: float = 300) -> Any:
    """Run `code` in a fresh Python (cwd: the checkout); the JSON it printed last."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- finding 1: Ray's session folders ----------------------------------------------------------------------

RAY_SESSION = """
import json, os, stat
from pathlib import Path

from services.dispatcher import connect_ray

assert connect_ray(num_cpus=1, namespace="session-modes-test", log_to_driver=False)
import ray


@ray.remote
def pid() -> int:
    return os.getpid()


ray.get(pid.remote())  # a worker process started: its folders are made too
session = Path(ray._private.worker._global_node.get_session_dir_path())  # Ray's own answer, for the test
folders = {str(session): stat.S_IMODE(session.stat().st_mode)}
for folder, subfolders, _ in os.walk(session):
    for name in subfolders:
        path = Path(folder) / name
        if not path.is_symlink():
            folders[str(path)] = stat.S_IMODE(path.lstat().st_mode)
above = [
    {"path": str(p), "mode": stat.S_IMODE(p.stat().st_mode), "uid": p.stat().st_uid}
    for p in session.parents
]
sockets = [
    str(Path(folder) / name)
    for folder, _, files in os.walk(session)
    for name in files
    if stat.S_ISSOCK((Path(folder) / name).lstat().st_mode)
]
ray.shutdown()
print(json.dumps({"session": str(session), "folders": folders, "above": above, "sockets": sockets}))
"""


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What a local Ray started by pelt left: its session folder, the modes of it and of every folder
    under it (after one task ran), the folders above it and its Unix sockets."""
    home = tmp_path_factory.mktemp("home")
    data = tmp_path_factory.mktemp("data")
    return run_child(RAY_SESSION, child_environment(HOME=str(home), PELT_DATA_DIR=str(data)))


def test_the_session_folders_of_pelts_local_ray_are_its_users_only(ray_session):
    opened = {path: oct(mode) for path, mode in ray_session["folders"].items() if mode & 0o077}
    assert opened == {}, f"Ray session folders open to other users: {opened}"
    assert len(ray_session["folders"]) > 3  # the session, its sockets, logs, runtime folders were seen
    private = [
        above for above in ray_session["above"] if above["uid"] == os.geteuid() and above["mode"] & 0o077 == 0
    ]
    assert private, f"no folder above {ray_session['session']} keeps other users out: {ray_session['above']}"
    assert ray_session["sockets"], "found no Unix socket of Ray's"
    assert all(len(os.fsencode(path)) <= 107 for path in ray_session["sockets"]), ray_session["sockets"]


@pytest.fixture
def short_temp_folder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temp folder (TMPDIR) taken as short enough for Ray's socket paths, removed afterwards."""
    from services.dispatcher import ray_cluster

    folder = Path(tempfile.mkdtemp(prefix="t-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setattr(ray_cluster, "RAY_SOCKET_PATH_MAX_BYTES", 200)  # whatever the user id's length
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def test_rays_temp_folder_is_kept_in_the_users_own_private_folder_and_never_in_anothers(short_temp_folder):
    from services.dispatcher.ray_cluster import private_ray_temp_dir

    own = short_temp_folder / f"pelt-ray-{os.geteuid()}"
    assert private_ray_temp_dir() == own / "ray"
    assert stat.S_IMODE(own.stat().st_mode) == 0o700
    own.chmod(0o777)  # widened meanwhile: made private again
    assert private_ray_temp_dir() == own / "ray" and stat.S_IMODE(own.stat().st_mode) == 0o700

    own.rmdir()
    elsewhere = short_temp_folder / "planted"
    elsewhere.mkdir(mode=0o777)
    own.symlink_to(elsewhere)  # a link planted where pelt's folder goes: not followed, not used
    chosen = private_ray_temp_dir()
    assert chosen.parent.parent == short_temp_folder and chosen.parent.name.startswith(own.name + "-")
    assert stat.S_IMODE(chosen.parent.stat().st_mode) == 0o700 and not chosen.parent.is_symlink()
    assert list(elsewhere.iterdir()) == []
    assert private_ray_temp_dir() == chosen  # the same fallback at the next start: none piles up
    assert sorted(p.name for p in short_temp_folder.iterdir()) == sorted(
        [own.name, chosen.parent.name, "planted"]
    )


def test_rays_temp_folder_goes_under_ray_tmpdir_where_it_is_set(short_temp_folder, monkeypatch):
    from services.dispatcher.ray_cluster import private_ray_temp_dir

    rays = short_temp_folder / "rays-own"
    rays.mkdir()
    monkeypatch.setenv("RAY_TMPDIR", str(rays))
    assert private_ray_temp_dir() == rays / f"pelt-ray-{os.geteuid()}" / "ray"


# --- finding 2: a job's memory budget is the machine's ----------------------------------------------------

BUDGET_UNDER_RLIMIT = f"""
import json, resource
resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_SPACE_LIMIT}, {ADDRESS_SPACE_LIMIT}))
import os
from services.settings import Settings
from workers.memory_budget import worker_memory_budget

answers = {{"service": Settings(data_dir="/nonexistent").worker_memory_bytes, "worker": worker_memory_budget()}}
os.environ["PELT_WORKER_MEMORY_BYTES"] = str(64 << 30)
answers["service_explicit"] = Settings(data_dir="/nonexistent").worker_memory_bytes
answers["worker_explicit"] = worker_memory_budget()
print(json.dumps(answers))
"""


def physical_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_the_default_budget_is_this_machines_memory_and_an_explicit_one_wins():
    from services.settings import Settings

    assert Settings(data_dir="/nonexistent").worker_memory_bytes <= physical_memory()
    answers = run_child(BUDGET_UNDER_RLIMIT, child_environment())
    assert answers == {
        "service": ADDRESS_SPACE_LIMIT,
        "worker": ADDRESS_SPACE_LIMIT,
        "service_explicit": 64 * GIB,
        "worker_explicit": 64 * GIB,
    }


def test_the_cgroup_limit_is_the_lowest_of_the_process_cgroup_and_those_above_it(tmp_path: Path):
    from pelt_core.limits import cgroup_memory_limit

    membership = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    (v2 / "service" / "worker").mkdir(parents=True)
    (v2 / "service" / "memory.max").write_text(f"{2 * GIB}\n")
    (v2 / "service" / "worker" / "memory.max").write_text("max\n")  # no limit of its own
    membership.write_text("0::/service/worker\n")
    assert cgroup_memory_limit(v2, membership) == 2 * GIB

    v1 = tmp_path / "v1"
    (v1 / "memory" / "pod" / "box").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory" / "pod" / "memory.limit_in_bytes").write_text(f"{3 * GIB}\n")
    (v1 / "memory" / "pod" / "box" / "memory.limit_in_bytes").write_text(f"{5 * GIB}\n")
    membership.write_text("9:name=systemd:/\n4:memory:/pod/box\n0::/\n")
    assert cgroup_memory_limit(v1, membership) == 3 * GIB

    membership.write_text("0::/\n")
    assert cgroup_memory_limit(tmp_path / "none", membership) is None


def test_a_job_whose_backbone_alone_exceeds_this_machines_memory_is_refused_at_submission(
    api: Api, client, toy_task
):
    """The default budget: a job estimated at the machine's memory plus 1 GiB is refused (a 32 GiB
    constant let a ~30 GiB job through on a 23 GiB machine), naming the backbone and the setting."""
    content_hash = api.registry.get_backbone("tiny-bert").content_hash
    source = api.registry.get_backbone("tiny-bert").source
    too_large = {**TINY_FACTS, "num_parameters": (physical_memory() + GIB) // 4}  # fp32 weights
    api.registry.register_backbone("machine-sized", source, content_hash, facts=too_large)
    error = refused(
        lambda: client.submit(toy_task, "lora", backbone="machine-sized"), 422, "backbone", "PELT_WORKER"
    )
    assert "the backbone's weights alone need" in error.message and "bfloat16" in error.message
    assert api.registry.list_jobs() == []


def worker_with_budget(monkeypatch: pytest.MonkeyPatch, budget: int, backbones: Any) -> Any:
    """A worker whose environment says PELT_WORKER_MEMORY_BYTES=budget (its machine may be another)."""
    from workers.worker import PeltWorker, WorkerConfig

    monkeypatch.setenv("PELT_WORKER_MEMORY_BYTES", str(budget))
    return PeltWorker("w1", WorkerConfig(threads=None, heartbeat_seconds=0.05), backbones=backbones)


def assert_failed_over_budget(outcome: Any, lease: Lease, budget: int) -> None:
    assert (outcome.status, outcome.retryable) == ("failed", False)
    ((end, (error, retryable)),) = lease.ends
    assert (end, retryable) == ("fail", False)
    assert error.startswith("MemoryBudgetError: batch_size: the job would need about"), error
    assert f"{budget:,} bytes" in error and "PELT_WORKER_MEMORY_BYTES" in error, error


def test_a_worker_whose_budget_is_below_the_api_hosts_fails_the_job_before_loading_anything(
    api: Api, client, toy_task, tiny_bert_dir, tmp_path, monkeypatch
):
    """The API host accepts a job under its own machine's budget; the worker that takes it has 1 MiB (by
    PELT_WORKER_MEMORY_BYTES in its environment), below the tiny job's ~4 MiB estimate: it fails the job
    with the reason, without mapping the backbone or training."""
    from pelt_core.backbones import Backbone
    from services.dispatcher.job_specs import JobSpecs
    from workers.backbone_store import LocalBackbones
    from workers.job import LocalDeltaSink

    class NeverMapped(LocalBackbones):
        def __call__(self, name: str, dtype: str = "float32") -> Any:
            raise AssertionError(f"the worker mapped backbone {name} for a job it cannot hold")

    backbone = Backbone.load(str(tiny_bert_dir))
    api.registry.register_backbone("tiny-sized", str(tiny_bert_dir), backbone.content_hash, backbone.facts)
    accepted = client.submit(toy_task, "lora", backbone="tiny-sized", hyperparameters={"batch_size": 4})
    job = JobSpecs(api.registry).build(api.registry.get_job(accepted.id))  # as the dispatcher hands it out
    assert job.backbone_facts == backbone.facts

    worker = worker_with_budget(monkeypatch, 1 << 20, NeverMapped())
    lease = Lease(job.job_id)
    outcome = worker.run(job, lease, LocalDeltaSink(tmp_path / "deltas"))

    assert_failed_over_budget(outcome, lease, 1 << 20)
    assert not (tmp_path / "deltas").exists()
    assert worker.info()["memory_bytes"] == 1 << 20


def test_without_the_registrys_facts_the_worker_checks_the_job_on_the_mapped_backbone_before_training(
    tiny_bert_dir, toy_files, tmp_path, monkeypatch
):
    import workers.worker
    from pelt_core import get_method
    from workers.backbone_store import LocalBackbones
    from workers.job import JobSpec, LocalDeltaSink, TaskSpec

    def never_trained(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the worker trained a job it cannot hold")

    monkeypatch.setattr(workers.worker, "train", never_trained)
    task = TaskSpec(
        "toy",
        str(toy_files["train"]),
        str(toy_files["validation"]),
        ("sentence",),
        "label",
        "single_label_classification",
        ("0", "1"),
        "accuracy",
    )
    job = JobSpec(
        job_id=1,
        task=task,
        method="lora",
        method_spec=get_method("lora").to_dict(),
        backbone=str(tiny_bert_dir),
        train_config={"max_steps": 2, "batch_size": 4, "seed": 1, "bf16": "false"},
    )
    worker = worker_with_budget(monkeypatch, 1 << 20, LocalBackbones())
    lease = Lease(1)
    outcome = worker.run(job, lease, LocalDeltaSink(tmp_path / "deltas"))

    assert_failed_over_budget(outcome, lease, 1 << 20)


WORKER_UNDER_RLIMIT = f"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_SPACE_LIMIT}, {ADDRESS_SPACE_LIMIT}))
from pelt_core import get_method
from workers.backbone_store import LocalBackbones
from workers.job import JobSpec, LocalDeltaSink, TaskSpec
from workers.worker import PeltWorker, WorkerConfig


class Lease:
    job_id, worker_id, ends = 1, "w1", []
    heartbeat = staticmethod(lambda progress=None: False)
    complete = staticmethod(lambda result: Lease.ends.append(("complete", None)))
    fail = staticmethod(lambda error, retryable: Lease.ends.append(("fail", (error, retryable))))


backbone, train, validation, deltas = sys.argv[1:5]
job = JobSpec(
    job_id=1,
    task=TaskSpec("toy", train, validation, ("sentence",), "label", "single_label_classification", ("0", "1"), "accuracy"),
    method="lora",
    method_spec=get_method("lora").to_dict(),
    backbone=backbone,
    train_config={{"max_steps": 2, "batch_size": 4096, "eval_batch_size": 4096, "seed": 1, "bf16": "false"}},
)
worker = PeltWorker("w1", WorkerConfig(threads=None, heartbeat_seconds=0.05), backbones=LocalBackbones())
outcome = worker.run(job, Lease(), LocalDeltaSink(deltas))
print(json.dumps({{"status": outcome.status, "retryable": outcome.retryable, "ends": Lease.ends}}))
"""


def test_a_worker_under_an_address_space_limit_fails_a_job_its_machine_cannot_hold(
    tiny_bert_dir, toy_files, tmp_path
):
    """No PELT_WORKER_MEMORY_BYTES on the worker: its budget is its own process's memory (RLIMIT_AS 3 GiB
    here), and a job estimated at 4.3 GiB (batch_size 4096) fails there with the reason."""
    code = WORKER_UNDER_RLIMIT
    arguments = [str(tiny_bert_dir), str(toy_files["train"]), str(toy_files["validation"]), str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-c", code, *arguments],
        cwd=ROOT,
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert (answer["status"], answer["retryable"]) == ("failed", False), answer
    ((end, (error, retryable)),) = answer["ends"]
    assert (end, retryable) == ("fail", False)
    assert error.startswith("MemoryBudgetError: batch_size:") and "more than a worker's 3.0 GiB" in error
    assert f"{ADDRESS_SPACE_LIMIT:,} bytes" in error, error


# --- finding 3: Ray's public means only ---------------------------------------------------------------------


def private_ray_imports(folder: Path) -> list[str]:
    """Where the code under `folder` imports a private module of Ray's (`ray._private`, `ray._raylet`...)."""
    found = []
    for file in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            if any(name.startswith("ray.") and name.split(".")[1].startswith("_") for name in names):
                found.append(f"{file.relative_to(ROOT)}:{node.lineno}")
    return found


def test_pelt_reaches_ray_through_its_public_means_only():
    assert [
        hit for part in ("services", "workers", "pelt_core") for hit in private_ray_imports(ROOT / part)
    ] == []


TOKEN_AUTH_AFTER_IMPORT = """
import json
import ray  # before pelt could set RAY_AUTH_MODE
from services.dispatcher import require_token_auth

try:
    require_token_auth()
    print(json.dumps("accepted"))
except RuntimeError as exc:
    print(json.dumps(str(exc)))
"""

TOKEN_AUTH_BEFORE_IMPORT = """
import json
from services.dispatcher import loopback_only, require_token_auth

require_token_auth()
loopback_only()
import ray.util
from ray._raylet import AuthenticationMode, get_authentication_mode  # the test asks Ray itself

print(json.dumps([get_authentication_mode() == AuthenticationMode.TOKEN, ray.util.get_node_ip_address()]))
"""


def test_token_auth_is_on_when_pelt_joins_and_a_process_that_imported_ray_first_is_refused():
    assert run_child(TOKEN_AUTH_BEFORE_IMPORT, child_environment()) == [True, "127.0.0.1"]
    answer = run_child(TOKEN_AUTH_AFTER_IMPORT, child_environment())
    assert "RAY_AUTH_MODE=token" in answer and "imported before" in answer, answer
