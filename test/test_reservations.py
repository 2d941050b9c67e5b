"""The staggering policy's reservation rings: exact slots for hand-made sequences."""

from __future__ import annotations

from sglang_vericache.speculative.reservations import VerifyReservations


def test_requests_spread_over_iterations_when_the_link_is_the_limit():
    r = VerifyReservations(horizon=8, link_bytes_per_iter=100, staging_tokens=1000)
    # Four requests start drafting together, each wanting to verify after 2 drafts, 60 bytes each:
    # only one fits an iteration's link budget, so they take iterations 2, 3, 4, 5.
    assert [r.reserve(2, 60, 10) for _ in range(4)] == [2, 3, 4, 5]


def test_small_verifications_share_an_iteration():
    r = VerifyReservations(horizon=4, link_bytes_per_iter=100, staging_tokens=1000)
    assert [r.reserve(1, 30, 10) for _ in range(4)] == [1, 1, 1, 2]
    assert r.slots[1].link_bytes == 10 and r.slots[2].link_bytes == 70


def test_staging_tokens_are_the_second_ring():
    r = VerifyReservations(horizon=4, link_bytes_per_iter=10**9, staging_tokens=100)
    assert [r.reserve(0, 1, 60), r.reserve(0, 1, 60), r.reserve(0, 1, 30)] == [0, 1, 0]


def test_advance_moves_the_window_and_frees_a_fresh_slot():
    r = VerifyReservations(horizon=3, link_bytes_per_iter=100, staging_tokens=100)
    assert r.reserve(0, 100, 1) == 0
    r.advance()
    assert r.iteration == 1
    assert [s.link_bytes for s in r.slots] == [100, 100, 100]
    assert r.reserve(0, 100, 1) == 1


def test_oversized_verification_takes_an_empty_slot_and_past_horizon_takes_the_last():
    r = VerifyReservations(horizon=3, link_bytes_per_iter=100, staging_tokens=100)
    assert r.reserve(0, 50, 1) == 0
    assert r.reserve(0, 500, 1) == 1  # bigger than any slot: the first empty one
    assert r.reserve(0, 80, 1) == 2
    assert r.reserve(0, 80, 1) == 2  # nothing fits within the horizon: the last slot, over budget
    assert r.slots[2].link_bytes == -60


def test_cancel_returns_the_booking_and_link_budget_updates_apply():
    r = VerifyReservations(horizon=3, link_bytes_per_iter=100, staging_tokens=100)
    it = r.reserve(1, 70, 20)
    r.cancel(it, 70, 20)
    assert (r.slots[1].link_bytes, r.slots[1].staging_tokens) == (100, 100)
    r.reserve(0, 40, 1)
    r.set_link_budget(150)
    assert [s.link_bytes for s in r.slots] == [110, 150, 150]


def test_unthrottled_link_stays_unthrottled():
    r = VerifyReservations(horizon=4, link_bytes_per_iter=float("inf"), staging_tokens=100)
    r.set_link_budget(float("inf"))
    assert [r.reserve(1, 10**12, 10) for _ in range(3)] == [1, 1, 1]
    r.set_link_budget(100.0)
    assert [s.link_bytes for s in r.slots] == [100.0, 100.0, 100.0, 100.0]
