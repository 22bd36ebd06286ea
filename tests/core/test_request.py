"""The Request's own methods: the only ways code outside the core changes a request."""

from __future__ import annotations

import pytest

from pagekv.core.request import Request, RequestStatus
from pagekv.sampling_params import SamplingParams


def _request(**kwargs: object) -> Request:
    params = SamplingParams(temperature=0, max_tokens=8)
    return Request("r", [5, 6, 7], params, **kwargs)  # type: ignore[arg-type]


def test_eos_token_ids_are_given_at_construction() -> None:
    request = _request(eos_token_ids=[2, 9])
    assert request.eos_token_ids == (2, 9)
    assert request.stop_status(9) is RequestStatus.FINISHED_STOPPED
    assert _request().eos_token_ids == ()
    assert _request().stop_status(9) is None


def test_replace_last_token_changes_only_an_uncomputed_token() -> None:
    request = _request()
    request.num_computed_tokens = 3
    request.append_token(11)
    request.replace_last_token(12)
    assert request.all_token_ids == [5, 6, 7, 12] and request.output_token_ids == [12]
    request.num_computed_tokens = 4
    with pytest.raises(AssertionError, match="already computed"):
        request.replace_last_token(13)


def test_hold_stops_the_target_short_of_the_last_token_until_released() -> None:
    request = _request()
    request.append_token(11)
    assert not request.held and request.num_target_tokens == 4
    request.hold()
    assert request.held and request.num_target_tokens == 3
    request.release_hold()
    assert not request.held and request.num_target_tokens == 4


def test_branch_off_continues_the_tokens_with_another_last_token() -> None:
    parent = _request(cache_salt="s", priority=2, eos_token_ids=[2])
    parent.append_token(11)
    parent.append_token(12)
    child = parent.branch_off("r#beam1", 13)
    assert child.request_id == "r#beam1"
    assert child.all_token_ids == [5, 6, 7, 11, 13] and parent.all_token_ids[-1] == 12
    assert child.prompt_token_ids is parent.prompt_token_ids  # shared, never written
    assert child.output_token_ids == [11, 13] and child.num_output_tokens == 2
    assert child.params is parent.params
    assert (child.cache_salt, child.priority, child.eos_token_ids) == ("s", 2, (2,))
    assert child.status is RequestStatus.WAITING and child.num_computed_tokens == 0
    assert parent.fork_children == [child]  # forked by the scheduler, with its blocks
    second = parent.branch_off("r#beam2", 14)
    assert parent.fork_children == [child, second]
