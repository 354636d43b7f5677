"""Fixtures of the registry tests: every database test runs on SQLite and on PostgreSQL.

PostgreSQL comes from PELT_TEST_DATABASE_URL (`make test` sets it; tests/postgres.py says when its tests
skip or fail without it); each test gets its own freshly created database (`pelt_test_<random>`, cloned
from a migrated template), dropped after the test. The clones are made ahead, two at a time, on a thread
of their own (`MigratedTemplates.postgres_copy`): `CREATE DATABASE` copies the template's every file and
waits for them on disk, which the test would otherwise wait for.
"""

from __future__ import annotations

import shutil
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import make_url

from services.registry import Registry, upgrade
from services.registry.testing import (
    FakeClock,
    create_postgres_database,
    drop_postgres_database,
    scratch_postgres,
    sqlite_url,
    write_jsonl,
)
from tests.postgres import postgres_url

BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
START = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


def postgres_base_url() -> str:
    return postgres_url("the PostgreSQL half of the registry tests")


class MigratedTemplates:
    """One migrated database per backend, made on first use; each test gets a fresh copy."""

    AHEAD = 2  # PostgreSQL copies made ahead of the tests that take them

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._sqlite: Path | None = None
        self._postgres: str | None = None
        self._maker: ThreadPoolExecutor | None = None
        self._ahead: deque[Future[str]] = deque()

    def sqlite_file(self) -> Path:
        if self._sqlite is None:
            path = self.folder / "template.db"
            upgrade(sqlite_url(path))
            self._sqlite = path
        return self._sqlite

    def postgres_name(self) -> str:
        if self._postgres is None:
            url = create_postgres_database(postgres_base_url(), prefix="pelt_test_template_")
            self._postgres = url
            upgrade(url)
        return str(make_url(self._postgres).database)

    def postgres_copy(self) -> str:
        """The URL of a fresh copy of the PostgreSQL template (the caller drops it): one made ahead, while
        the next ones are being made."""
        template = self.postgres_name()
        if self._maker is None:
            self._maker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pelt-test-databases")
        while len(self._ahead) < self.AHEAD + 1:
            self._ahead.append(
                self._maker.submit(create_postgres_database, postgres_base_url(), template=template)
            )
        return self._ahead.popleft().result()

    def close(self) -> None:
        """Drop every database made: the copies made ahead and not taken, then the template (one that
        cannot be dropped does not keep the others)."""
        made = []
        if self._maker is not None:
            self._maker.shutdown(wait=True)
            made = [ahead.result() for ahead in self._ahead if ahead.exception() is None]
        failures = []
        for url in [*made, *([self._postgres] if self._postgres is not None else [])]:
            try:
                drop_postgres_database(url)
            except Exception as exc:  # every database gets its drop; the failures are raised after
                failures.append(f"{make_url(url).database}: {exc}")
        if failures:
            raise RuntimeError("could not drop the test databases " + "; ".join(failures))


@pytest.fixture(scope="session")
def templates(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MigratedTemplates]:
    holder = MigratedTemplates(tmp_path_factory.mktemp("registry-templates"))
    yield holder
    holder.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The database under test: "sqlite" or "postgresql"."""
    if request.param == "postgresql":
        postgres_base_url()
    return request.param


@pytest.fixture
def db_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database (no schema), dropped after the test."""
    if backend == "sqlite":
        yield sqlite_url(tmp_path / "registry.db")
        return
    with scratch_postgres(postgres_base_url()) as url:
        yield url


@pytest.fixture
def migrated_url(backend: str, tmp_path: Path, templates: MigratedTemplates) -> Iterator[str]:
    """A fresh database at the head revision (a copy of a migrated template), dropped after the test."""
    if backend == "sqlite":
        path = tmp_path / "registry.db"
        shutil.copyfile(templates.sqlite_file(), path)
        yield sqlite_url(path)
        return
    url = templates.postgres_copy()
    try:
        yield url
    finally:
        drop_postgres_database(url)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture
def registry(migrated_url: str, clock: FakeClock) -> Iterator[Registry]:
    """A registry on a fresh database, with a clock the test moves by hand."""
    with Registry(
        migrated_url,
        clock=clock,
        lease_seconds=60,
        max_attempts=3,
        retry_backoff_seconds=5,
        retry_backoff_max_seconds=600,
    ) as opened:
        yield opened


@pytest.fixture
def sst2_file(tmp_path: Path) -> Path:
    """40 training rows: a sentence and a positive/negative label."""
    rows = [{"sentence": f"sentence number {i}", "label": ["negative", "positive"][i % 2]} for i in range(40)]
    return write_jsonl(tmp_path / "sst2-train.jsonl", rows)


@pytest.fixture
def ready(registry: Registry, sst2_file: Path) -> Registry:
    """The registry with task `sst2` (40 training rows) and backbone `tiny-bert` registered."""
    registry.register_task("sst2", sst2_file, text_fields=["sentence"], label_field="label")
    registry.register_backbone("tiny-bert", "hf:prajjwal1/bert-tiny", "sha256:" + "ab" * 32)
    return registry
