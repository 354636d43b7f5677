"""Property-based fuzzing of the API against its own OpenAPI schema (schemathesis + hypothesis): for every
operation, generated requests (valid and invalid bodies, parameters and uploads) never make the service
answer 5xx, and every answer has the documented content type and matches the documented schema.

Then sequences of calls along the links between operations (schemathesis' state machine: an id or a
name one answer returns feeds the next call), and bodies built to get deep into two routes the schema
describes only loosely: compositions (POST /v1/compose) and multipart task registrations (POST
/v1/tasks). None answers 5xx, and a refused one writes nothing."""

from __future__ import annotations

import io
import json
from pathlib import Path

import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
)

from pelt_core.vocabulary import COMPOSE_OPERATIONS
from tests.api.conftest import BACKBONE, Api

EXAMPLES_PER_OPERATION = 30
STATEFUL_SCENARIOS, STATEFUL_STEPS = 30, 10  # bounded: about 10 s on 2 cores
COMPOSE_EXAMPLES, UPLOAD_EXAMPLES = (
    40,
    100,
)  # about 12 s and 3 s (most compositions succeed and write a version)
FUZZ_SETTINGS = settings(
    deadline=None, database=None, suppress_health_check=list(HealthCheck), derandomize=True
)


def stored_delta(api: Api, toy_files, folder) -> None:
    """One delta version of task "toy" in the MLflow store, so that the deltas routes get past 404."""
    from pelt_core import TrainConfig, get_method
    from pelt_core.backbones import Backbone
    from pelt_core.data import load_table
    from pelt_core.delta import save_delta
    from pelt_core.train import train

    backbone = Backbone.load(api.registry.get_backbone("tiny-bert").source)
    run = train(
        backbone,
        get_method("lora"),
        load_table(toy_files["train"]),
        load_table(toy_files["validation"]),
        TrainConfig(max_steps=2, batch_size=4),
    )
    api.store.register("toy", save_delta(run.delta, backbone, folder).path)


def test_no_generated_request_makes_the_service_answer_5xx(api: Api, toy_files, tmp_path):
    api.client().register_task("toy", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    stored_delta(api, toy_files, tmp_path / "delta")
    headers = {"Authorization": f"Bearer {api.token}"}
    schema = schemathesis.openapi.from_asgi(
        "/openapi.json", api.app, headers=headers
    )  # the schema needs a token
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20
    checks = [not_a_server_error, response_schema_conformance, content_type_conformance]
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def survives(case) -> None:
            case.call_and_validate(headers=headers, checks=checks)

        survives()


def lora_versions(api: Api, folder: Path) -> None:
    """Versions 1 and 2 of task "toy": random rank-2 LoRA deltas on the tiny backbone (no training)."""
    import torch

    from pelt_core.backbones import Backbone
    from pelt_core.delta import save_delta
    from pelt_core.methods import get_method
    from pelt_core.model import JobDelta

    backbone = Backbone.load(api.registry.get_backbone(BACKBONE).source)
    for seed in (0, 1):
        torch.manual_seed(seed)
        delta = JobDelta(get_method("lora", {"r": 2}), backbone, num_labels=2, label_names=["0", "1"])
        api.store.register("toy", save_delta(delta, backbone, folder / f"lora-{seed}").path)


def test_sequences_of_calls_along_the_schemas_links_never_answer_5xx(api: Api, toy_task, tmp_path):
    lora_versions(api, tmp_path)
    client = api.client()
    client.submit(toy_task, "lora", backbone=BACKBONE)
    client.sweep(toy_task, ["bitfit", "lora"], backbone=BACKBONE)  # ids for the links to carry
    headers = {"Authorization": f"Bearer {api.token}"}
    schema = schemathesis.openapi.from_asgi("/openapi.json", api.app, headers=headers)
    checks = [not_a_server_error, response_schema_conformance, content_type_conformance]

    class Authorized(schema.as_state_machine()):
        def get_call_kwargs(self, case) -> dict:
            return {"headers": headers}

        def validate_response(self, response, case, additional_checks=None, **kwargs) -> None:
            case.validate_response(response, checks=checks, transport_kwargs=kwargs)

    assert schema.statistic.transitions.total >= 20  # the links schemathesis found between the operations
    Authorized.run(
        settings=settings(FUZZ_SETTINGS, max_examples=STATEFUL_SCENARIOS, stateful_step_count=STATEFUL_STEPS)
    )


# Half the bodies are well-formed (a composition that can succeed, with random options), the others have
# odd parts: a body of pure noise would only ever meet the first check.
REFERENCES = st.sampled_from(
    [
        "toy/1",
        "toy/2",
        "toy",
        "toy@best",
        "toy/99",
        "nope",
        "toy/0",
        "",
        "toy@",
        "../toy",
        "toy/1/2",
        "x" * 300,
    ]
)
MERGE_OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "how": st.sampled_from(["linear", "ties", "dare"]),
        "density": st.floats(0.05, 1.0),
        "seed": st.integers(0, 99),
        "weights": st.lists(st.floats(0.1, 2.0), min_size=2, max_size=2),
        "lora_rank": st.integers(1, 4),
    },
)
WELL_FORMED_COMPOSITIONS = st.one_of(
    st.fixed_dictionaries(
        {"op": st.just("merge"), "sources": st.just(["toy/1", "toy/2"]), "options": MERGE_OPTIONS}
    ),
    st.fixed_dictionaries(
        {
            "op": st.just("average"),
            "sources": st.just(["toy/1", "toy/2"]),
            "options": st.fixed_dictionaries({}, optional={"lora_rank": st.integers(1, 4)}),
        }
    ),
    st.fixed_dictionaries(
        {
            "op": st.just("merge_lora_svd"),
            "sources": st.just(["toy/1", "toy/2"]),
            "options": st.fixed_dictionaries({}, optional={"rank": st.integers(1, 4)}),
        }
    ),
    st.fixed_dictionaries(
        {"op": st.just("multi_task"), "sources": st.just({"first": "toy/1", "second": "toy/2"})}
    ),
).flatmap(
    lambda body: st.fixed_dictionaries(
        {
            **{key: st.just(value) for key, value in body.items()},
            "into": st.sampled_from(["soup", "mix", "toy"]),
        },
        optional={
            "aliases": st.sampled_from([["soup"], ["mixed", "v2"]]),
            "description": st.text(max_size=30),
        },
    )
)
ODD_COMPOSITIONS = st.fixed_dictionaries(
    {
        "op": st.sampled_from([*COMPOSE_OPERATIONS, "explode"]),
        "sources": st.one_of(
            st.lists(REFERENCES, max_size=4),
            st.dictionaries(st.sampled_from(["a", "b", "", "a b", "x" * 80]), REFERENCES, max_size=3),
        ),
        "into": st.sampled_from(["soup", "toy", "", "../etc", "x" * 200, "new task"]),
    },
    optional={
        "options": st.dictionaries(
            st.sampled_from(
                ["weights", "how", "density", "seed", "scale", "combine", "lora_rank", "rank", "bogus"]
            ),
            st.one_of(
                st.sampled_from(["linear", "ties", "x"]),
                st.lists(st.floats(-2, 2), max_size=3),
                st.floats(-1, 2),
                st.integers(-3, 40),
                st.integers(-(2**70), 2**70),
                st.none(),
                st.booleans(),
                st.text(max_size=10),
            ),
            max_size=3,
        ),
        "aliases": st.lists(st.sampled_from(["soup", "best", "best-lora", "", "a b", "x" * 80]), max_size=2),
    },
)
COMPOSE_BODIES = st.one_of(WELL_FORMED_COMPOSITIONS, ODD_COMPOSITIONS)


def test_generated_compositions_never_answer_5xx_and_a_refused_one_writes_no_version(
    api: Api, toy_task, tmp_path
):
    lora_versions(api, tmp_path)
    http = TestClient(api.app)
    headers = {"Authorization": f"Bearer {api.token}"}

    def versions() -> int:
        return sum(len(api.store.list_versions(task)) for task in api.store.list_tasks())

    @given(body=COMPOSE_BODIES)
    @settings(FUZZ_SETTINGS, max_examples=COMPOSE_EXAMPLES)
    def survives(body) -> None:
        before = versions()
        response = http.post("/v1/compose", json=body, headers=headers)
        assert response.status_code < 500, (body, response.text)
        assert versions() == before + (response.status_code == 201), (body, response.text)

    survives()


TOY_ROWS = b"".join(json.dumps({"sentence": f"row {i}", "label": i % 2}).encode() + b"\n" for i in range(8))
TOY_CSV = b"sentence,label\n" + b"".join(f"row {i},{i % 2}\n".encode() for i in range(8))
WELL_FORMED_UPLOADS = st.tuples(
    st.sampled_from(["fuzzed", "fuzzed-2", "fuzzed_3"]),
    st.fixed_dictionaries(
        {"text_fields": st.just(["sentence"])},
        optional={
            "label_names": st.just(["neg", "pos"]),
            "max_length": st.integers(1, 512),
            "metric": st.sampled_from(["accuracy", "f1"]),
            "description": st.text(max_size=20),
        },
    ).map(json.dumps),
    st.sampled_from(
        [
            [("train", "train.jsonl", TOY_ROWS)],
            [("train", "train.csv", TOY_CSV)],
            [("train", "train.jsonl", TOY_ROWS), ("validation", "dev.csv", TOY_CSV)],
        ]
    ),
)
ODD_FILES = st.lists(
    st.tuples(
        st.sampled_from(["train", "validation", "test", "dataset", "extra"]),
        st.sampled_from(
            [
                "train.jsonl",
                "train.csv",
                "train.tsv",
                "train.parquet",
                "data.zip",
                "data.tar.gz",
                "../../etc/passwd",
                "",
                "a" * 300 + ".jsonl",
                "train.exe",
            ]
        ),
        st.one_of(
            st.sampled_from(
                [
                    TOY_ROWS,
                    TOY_CSV,
                    TOY_ROWS[:37],
                    b"PAR1\x00\x00PAR1",
                    b"PK\x03\x04broken",
                    b'{"sentence": "x", "label": {"a": [1]}}\n',
                    b'{"sentence": "x", "label": 7}\n' * 3,
                    "caf\u00e9,1\n".encode("latin-1"),
                ]
            ),
            st.binary(max_size=200),
        ),
    ),
    max_size=3,
    unique_by=lambda part: part[0],
)
ODD_UPLOADS = st.tuples(
    st.sampled_from(["fuzzed", "", "../x", "a" * 150, "fuzzed 2"]),
    st.one_of(
        st.fixed_dictionaries(
            {
                "text_fields": st.one_of(
                    st.just(["sentence"]),
                    st.just("sentence"),
                    st.integers(),
                    st.lists(st.sampled_from(["sentence", "label", "x", ""]), max_size=3),
                )
            },
            optional={
                "label_field": st.sampled_from(["label", "sentence", "missing", ""]),
                "problem_type": st.sampled_from(
                    ["single_label_classification", "regression", "multi_label_classification", "other"]
                ),
                "label_names": st.one_of(st.none(), st.lists(st.text(max_size=5), max_size=3)),
                "max_length": st.integers(-5, 10**7),
                "metric": st.sampled_from(["accuracy", "pearson", "nope"]),
            },
        ).map(json.dumps),
        st.sampled_from(["", "{", "[]", "null", '{"text_fields": ["sentence"], "extra": 1}']),
    ),
    ODD_FILES,
)
UPLOADS = st.one_of(WELL_FORMED_UPLOADS, ODD_UPLOADS)


def test_generated_multipart_task_registrations_never_answer_5xx_and_a_refused_one_writes_nothing(api: Api):
    http = TestClient(api.app)
    headers = {"Authorization": f"Bearer {api.token}"}

    @given(upload=UPLOADS)
    @settings(FUZZ_SETTINGS, max_examples=UPLOAD_EXAMPLES)
    def survives(upload) -> None:
        name, definition, parts = upload
        tasks, files = api.registry.list_tasks(), api.files()
        response = http.post(
            "/v1/tasks",
            data={"name": name, "definition": definition},
            headers=headers,
            files=[(field, (filename, io.BytesIO(content))) for field, filename, content in parts],
        )
        assert response.status_code < 500, (upload, response.text)
        if response.status_code >= 400:
            assert (api.registry.list_tasks(), api.files()) == (tasks, files), response.text

    survives()
