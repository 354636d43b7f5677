"""Dispatcher leadership: one dispatcher leads a Ray namespace; the others stand by until its row expires."""

from __future__ import annotations

import threading

import pytest

from services.registry import Registry, RegistryValidationError
from services.registry.testing import FakeClock


def test_the_first_dispatcher_leads_and_a_second_stands_by_while_the_leader_renews(
    registry: Registry, clock: FakeClock
):
    assert registry.acquire_leadership("pelt", "a", ttl_seconds=15)
    assert not registry.acquire_leadership("pelt", "b", ttl_seconds=15)

    clock.advance(10)
    assert registry.renew_leadership("pelt", "a", ttl_seconds=15)
    clock.advance(10)  # 20 s after a took over, 10 s after it renewed

    assert not registry.acquire_leadership("pelt", "b", ttl_seconds=15)
    assert registry.leader("pelt").holder == "a"


def test_a_standby_takes_over_once_the_leaders_row_expires_and_the_old_leader_cannot_renew(
    registry: Registry, clock: FakeClock
):
    registry.acquire_leadership("pelt", "a", ttl_seconds=15)
    clock.advance(16)  # a died or stalled

    assert registry.leader("pelt") is None
    assert registry.acquire_leadership("pelt", "b", ttl_seconds=15)
    assert not registry.renew_leadership("pelt", "a", ttl_seconds=15)  # a woke up: it no longer leads
    assert not registry.acquire_leadership("pelt", "a", ttl_seconds=15)
    leader = registry.leader("pelt")
    assert (leader.holder, leader.acquired_at) == ("b", clock.now)


def test_a_released_namespace_is_taken_at_once_and_namespaces_are_led_apart(registry: Registry):
    registry.acquire_leadership("pelt", "a", ttl_seconds=15)
    registry.acquire_leadership("other", "b", ttl_seconds=15)

    assert not registry.release_leadership("pelt", "b")  # only the holder can give it up
    assert registry.release_leadership("pelt", "a")
    assert registry.acquire_leadership("pelt", "c", ttl_seconds=15)
    assert registry.leader("other").holder == "b"


def test_a_leader_asking_again_keeps_its_leadership_and_extends_it(registry: Registry, clock: FakeClock):
    registry.acquire_leadership("pelt", "a", ttl_seconds=15)
    first = registry.leader("pelt")
    clock.advance(5)

    assert registry.acquire_leadership("pelt", "a", ttl_seconds=15)
    again = registry.leader("pelt")
    assert again.acquired_at == first.acquired_at and again.expires_at > first.expires_at


def test_of_many_standbys_asking_at_once_exactly_one_leads(registry: Registry):
    won: list[str] = []
    barrier = threading.Barrier(6)

    def ask(holder: str) -> None:
        barrier.wait()
        if registry.acquire_leadership("pelt", holder, ttl_seconds=15):
            won.append(holder)

    threads = [threading.Thread(target=ask, args=(f"d{i}",)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(won) == 1
    assert registry.leader("pelt").holder == won[0]


@pytest.mark.parametrize(
    ("namespace", "holder", "ttl", "field"),
    [("", "a", 15, "namespace"), ("pelt", "x" * 201, 15, "holder"), ("pelt", "a", 0, "ttl_seconds")],
)
def test_bad_leadership_arguments_are_refused_naming_the_field(registry, namespace, holder, ttl, field):
    with pytest.raises(RegistryValidationError) as refused:
        registry.acquire_leadership(namespace, holder, ttl_seconds=ttl)
    assert refused.value.field == field
