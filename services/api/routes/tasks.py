"""/v1/tasks: register a task from uploaded data, list and read tasks."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, UploadFile
from pydantic import ValidationError

from services.api.bodies import BoundedJsonRoute, check_json_depth, known_form_fields
from services.api.dependencies import READ, WRITE, Name, Operations
from services.api.error_handlers import validation_error
from services.api.schemas import TaskDefinition, TaskOut
from services.errors import ServiceError
from services.uploads import FIELDS as UPLOAD_FIELDS
from services.uploads import Upload

router = APIRouter(tags=["tasks"], route_class=BoundedJsonRoute)  # JSON nests at most MAX_JSON_DEPTH deep


@router.post(
    "/tasks",
    response_model=TaskOut,
    status_code=201,
    dependencies=[WRITE, Depends(known_form_fields(UPLOAD_FIELDS))],
)
def register_task(
    operations: Operations,
    name: Annotated[str, Form(min_length=1, max_length=100, description="task name")],
    definition: Annotated[str, Form(max_length=100_000, description="TaskDefinition as JSON")],
    train: Annotated[UploadFile | None, File(description="JSON Lines, CSV/TSV or Parquet")] = None,
    validation: Annotated[UploadFile | None, File()] = None,
    test: Annotated[UploadFile | None, File()] = None,
    dataset: Annotated[
        UploadFile | None, File(description="zip/tar.gz of a datasets save_to_disk folder")
    ] = None,
) -> Any:
    """Register a task from uploaded data; fields and labels are checked against it (nothing is kept
    when they do not fit). Another form field than these, or one sent twice, is a 422 naming it."""
    check_json_depth(definition, "definition")
    try:
        parsed = TaskDefinition.model_validate(json.loads(definition))
    except json.JSONDecodeError as exc:
        raise ServiceError(f"definition: not JSON ({exc})", status=422, field="definition") from None
    except ValidationError as exc:
        raise validation_error(exc, "definition") from None
    uploads = {
        key: Upload(f.filename or "", f.file)
        for key, f in (("train", train), ("validation", validation), ("test", test), ("dataset", dataset))
        if f
    }
    return operations.register_task(name, uploads, parsed.model_dump(exclude_unset=True))


@router.get("/tasks", response_model=list[TaskOut], dependencies=[READ])
def list_tasks(operations: Operations) -> Any:
    return operations.list_tasks()


@router.get("/tasks/{name}", response_model=TaskOut, dependencies=[READ])
def get_task(operations: Operations, name: Name) -> Any:
    return operations.get_task(name)
