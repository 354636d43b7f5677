"""Names a user gives (tasks, methods, backbones, aliases, namespaces, bundle routes) are checked whole: a name
with a trailing newline would otherwise pass `re.match(...$)` and pose as another name on the page and plots."""

from __future__ import annotations

import pytest

from pelt_core.delta_format import DeltaError, bundle_task_path
from services.delta_store.aliases import check_alias
from services.delta_store.errors import DeltaStoreError
from services.registry import RegistryValidationError
from services.registry.validation import check_name


@pytest.mark.parametrize("name", ["sentiment\n", "sentiment\r\n", "\nsentiment", "senti ment"])
def test_a_registry_name_with_a_newline_or_space_is_refused(name):
    with pytest.raises(RegistryValidationError, match="is not a valid name"):
        check_name(name)


def test_aliases_and_bundle_routes_are_checked_whole_too():
    with pytest.raises(DeltaStoreError, match="is not an alias"):
        check_alias("soup\n", "alias")
    with pytest.raises(DeltaError, match="route name"):
        bundle_task_path("sst2\n")
    assert check_name("sentiment") == "sentiment"
