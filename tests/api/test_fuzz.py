"""Property-based fuzzing of the API against its own OpenAPI schema (schemathesis + hypothesis): for every
operation, generated requests (valid and invalid bodies, parameters and uploads) never make the service
answer 5xx, and every answer has the documented content type and matches the documented schema."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
)

from tests.api.conftest import Api  # noqa: E402

EXAMPLES_PER_OPERATION = 30


def stored_delta(api: Api, toy_files, folder) -> None:
    """One delta version of task "toy" in the MLflow store, so that the deltas routes get past 404."""
    from pelt_core import TrainConfig, get_method
    from pelt_core.backbones import Backbone
    from pelt_core.data import load_table
    from pelt_core.delta import save_delta
    from pelt_core.train import train

    backbone = Backbone.load(api.registry.get_backbone("tiny-bert").source)
    run = train(backbone, get_method("lora"), load_table(toy_files["train"]), load_table(toy_files["validation"]),
                TrainConfig(max_steps=2, batch_size=4))
    api.store.register("toy", save_delta(run.delta, backbone, folder).path)


def test_no_generated_request_makes_the_service_answer_5xx(api: Api, toy_files, tmp_path):
    api.client().register_task("toy", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
    stored_delta(api, toy_files, tmp_path / "delta")
    schema = schemathesis.openapi.from_asgi("/openapi.json", api.app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20
    headers = {"Authorization": f"Bearer {api.token}"}
    checks = [not_a_server_error, response_schema_conformance, content_type_conformance]
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def survives(case) -> None:
            case.call_and_validate(headers=headers, checks=checks)

        survives()
