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


def test_no_generated_request_makes_the_service_answer_5xx(api: Api, toy_files):
    api.client().register_task("toy", toy_files["train"], toy_files["validation"], text_fields=["sentence"])
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
