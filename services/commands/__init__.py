"""The service's `pelt` commands, one module per group (as the API is split by resource):

- `serve`: `pelt serve`, the whole service in one process;
- `tasks`: `pelt task register|list|show` (`pelt task add`, its old name, still works);
- `methods`: `pelt method register|list|show` (the service's methods; `pelt methods` counts the built-ins'
  parameters locally, no service);
- `backbones`: `pelt backbone register|list|show`;
- `jobs`: `pelt submit`, `sweep`, `jobs`, `watch`, `cancel`, `result`, `events`;
- `deltas`: `pelt leaderboard`, `pull`, `compose`, `versions list|archive`;
- `admin`: `pelt token create|list|revoke` (run next to the registry: tokens are made and revoked there,
  never over the API; each has a scope: read, predict, write or admin) and `pelt audit`;
- `predict`: `pelt predict TASK TEXT...` (or `--file`), predictions from a running service;
- `search`: `pelt search TASK --budget N` (a budget-aware method search), `show`, `list`, `cancel`;
- `study`: `pelt study`, UniPELT's low-resource study through the service (`services.study`);
- `common`: what they share (the service's refusals as click errors, `--set` parsing, tables).

The client commands talk to PELT_API_URL (default http://127.0.0.1:8000) with PELT_API_TOKEN, or with
the token `pelt serve` left in PELT_DATA_DIR/api_token.
"""

from services.commands.admin import audit_command, token_group
from services.commands.backbones import backbone_group
from services.commands.deltas import compose_command, leaderboard_command, pull_command, versions_group
from services.commands.jobs import (
    cancel_command,
    events_command,
    fuse_command,
    jobs_command,
    result_command,
    submit_command,
    sweep_command,
    watch_command,
)
from services.commands.methods import method_group
from services.commands.predict import predict_command
from services.commands.search import search_group
from services.commands.serve import serve_command
from services.commands.study import study_command
from services.commands.tasks import task_group

SERVICE_COMMANDS = [
    serve_command,
    task_group,
    method_group,
    backbone_group,
    submit_command,
    fuse_command,
    sweep_command,
    search_group,
    jobs_command,
    watch_command,
    cancel_command,
    result_command,
    events_command,
    leaderboard_command,
    pull_command,
    predict_command,
    compose_command,
    versions_group,
    token_group,
    audit_command,
    study_command,
]

__all__ = ["SERVICE_COMMANDS"]
