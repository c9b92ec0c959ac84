"""Handler results as the worker stores them: plain JSON, bounded, or a permanent error."""

from __future__ import annotations

import math

import pytest

from sqla_outbox import errors
from sqla_outbox.results import encode_result


def test_plain_json_is_encoded_compactly_and_none_stores_nothing() -> None:
    assert encode_result("quote", None, max_bytes=10) is None
    assert (
        encode_result("quote", {"a": [1, 2.5, True, None, "é"]}, max_bytes=100)
        == '{"a":[1,2.5,true,null,"é"]}'
    )


def test_the_limit_counts_utf8_bytes() -> None:
    assert encode_result("quote", "é" * 4, max_bytes=10) == '"éééé"'  # 8 + 2 bytes
    with pytest.raises(errors.ResultTooLarge) as caught:
        encode_result("quote", "é" * 5, max_bytes=10)
    assert (caught.value.size_bytes, caught.value.limit_bytes, caught.value.task) == (12, 10, "quote")
    assert isinstance(caught.value, errors.PermanentError)


@pytest.mark.parametrize(
    "value",
    [{1, 2}, object(), {"x": math.nan}, math.inf, {"k": b"bytes"}, "nul\x00", "\ud800"],
)
def test_values_jsonb_cannot_hold_fail_permanently(value: object) -> None:
    with pytest.raises(
        errors.ResultNotSerializable, match="task 'quote' returned a value that is not plain JSON"
    ):
        encode_result("quote", value, max_bytes=1000)
