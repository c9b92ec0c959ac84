"""The AWS-strict SQS double (tests/strict_sqs.py) refuses what AWS refuses, in both protocols.

Every test runs with a JSON-protocol client (what botocore speaks today) and a
query-protocol one (form requests, XML answers: what older botocore spoke), against the
session's moto server, which is always the strict one.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from botocore.exceptions import ClientError

from tests import support

pytestmark = pytest.mark.parametrize("protocol", ["json", "query"])


@pytest.fixture
def queue(sqs_endpoint: str) -> str:
    client = support.sqs_client(sqs_endpoint)
    return str(
        client.create_queue(
            QueueName=f"strict-{uuid.uuid4().hex[:8]}",
            Attributes={"MaximumMessageSize": "1024", "VisibilityTimeout": "30"},
        )["QueueUrl"]
    )


def _client(endpoint: str, protocol: str) -> Any:
    return support.sqs_client(endpoint, protocol=protocol)


def _error(excinfo: pytest.ExceptionInfo[ClientError]) -> tuple[str, str]:
    error = excinfo.value.response["Error"]
    return error["Code"], error["Message"]


def _receive(client: Any, queue: str, visibility: int = 0) -> list[dict[str, Any]]:
    return list(
        client.receive_message(
            QueueUrl=queue,
            MaxNumberOfMessages=10,
            VisibilityTimeout=visibility,
            AttributeNames=["All"],
            MessageAttributeNames=["All"],
        ).get("Messages", [])
    )


@pytest.mark.parametrize("body", ["nul \x00 here", "escape \x1b", "bell \x07", "not a char \uffff"])
def test_a_body_outside_the_xml_character_set_is_refused(
    sqs_endpoint: str, queue: str, protocol: str, body: str
) -> None:
    client = _client(sqs_endpoint, protocol)
    with pytest.raises(ClientError) as refused:
        client.send_message(QueueUrl=queue, MessageBody=body)
    code, message = _error(refused)
    assert code == "InvalidMessageContents"
    assert "Invalid binary character" in message
    response = client.send_message_batch(
        QueueUrl=queue,
        Entries=[{"Id": "bad", "MessageBody": body}, {"Id": "good", "MessageBody": "tab\tok é 😀"}],
    )
    assert [entry["Id"] for entry in response["Successful"]] == ["good"]
    (failed,) = response["Failed"]
    assert (failed["Id"], failed["Code"], failed["SenderFault"]) == ("bad", "InvalidMessageContents", True)
    assert [m["Body"] for m in _receive(client, queue)] == ["tab\tok é 😀"]


def test_string_attribute_values_follow_the_same_character_set(
    sqs_endpoint: str, queue: str, protocol: str
) -> None:
    client = _client(sqs_endpoint, protocol)
    bad = {"error": {"DataType": "String", "StringValue": "upstream said \x00"}}
    with pytest.raises(ClientError) as refused:
        client.send_message(QueueUrl=queue, MessageBody="x", MessageAttributes=bad)
    code, message = _error(refused)
    assert code == "InvalidParameterValue"
    assert "'error'" in message
    empty = {"error": {"DataType": "String", "StringValue": ""}}
    with pytest.raises(ClientError) as refused:
        client.send_message(QueueUrl=queue, MessageBody="x", MessageAttributes=empty)
    assert _error(refused)[0] == "InvalidParameterValue"
    response = client.send_message_batch(
        QueueUrl=queue, Entries=[{"Id": "a", "MessageBody": "x", "MessageAttributes": bad}]
    )
    assert response.get("Successful", []) == []
    assert response["Failed"][0]["Code"] == "InvalidParameterValue"


def test_more_than_ten_message_attributes_are_refused(sqs_endpoint: str, queue: str, protocol: str) -> None:
    client = _client(sqs_endpoint, protocol)
    eleven = {f"a{i}": {"DataType": "String", "StringValue": "v"} for i in range(11)}
    with pytest.raises(ClientError) as refused:
        client.send_message(QueueUrl=queue, MessageBody="x", MessageAttributes=eleven)
    code, message = _error(refused)
    assert code == "InvalidParameterValue"
    assert "[11]" in message
    ten = dict(list(eleven.items())[:10])
    client.send_message(QueueUrl=queue, MessageBody="x", MessageAttributes=ten)


def test_delay_seconds_above_900_is_refused(sqs_endpoint: str, queue: str, protocol: str) -> None:
    client = _client(sqs_endpoint, protocol)
    with pytest.raises(ClientError) as refused:
        client.send_message(QueueUrl=queue, MessageBody="x", DelaySeconds=901)
    assert _error(refused)[0] == "InvalidParameterValue"
    response = client.send_message_batch(
        QueueUrl=queue,
        Entries=[{"Id": "late", "MessageBody": "x", "DelaySeconds": 901}, {"Id": "ok", "MessageBody": "y"}],
    )
    assert [e["Id"] for e in response["Failed"]] == ["late"]


def test_sizes_count_utf8_bytes_of_body_and_attributes_against_the_queue_limit(
    sqs_endpoint: str, queue: str, protocol: str
) -> None:
    client = _client(sqs_endpoint, protocol)
    # 342 characters, 1,026 bytes: moto counts characters and would take it
    with pytest.raises(ClientError) as refused:
        client.send_message(QueueUrl=queue, MessageBody="中" * 342)
    assert _error(refused) == (
        "InvalidParameterValue",
        "One or more parameters are invalid. Reason: Message must be shorter than 1024 bytes.",
    )
    attribute = {"note": {"DataType": "String", "StringValue": "é" * 10}}  # 4 + 6 + 20 bytes
    with pytest.raises(ClientError):
        client.send_message(QueueUrl=queue, MessageBody="x" * 995, MessageAttributes=attribute)
    client.send_message(QueueUrl=queue, MessageBody="x" * 994, MessageAttributes=attribute)  # 1,024
    with pytest.raises(ClientError) as refused:
        client.send_message_batch(
            QueueUrl=queue,
            Entries=[{"Id": "a", "MessageBody": "x" * 600}, {"Id": "b", "MessageBody": "y" * 600}],
        )
    code, message = _error(refused)
    assert code == "BatchRequestTooLong"
    assert "1200 bytes" in message


@pytest.mark.parametrize(
    ("method", "entry"),
    [
        ("send_message_batch", {"MessageBody": "x"}),
        ("delete_message_batch", {"ReceiptHandle": "h"}),
        ("change_message_visibility_batch", {"ReceiptHandle": "h", "VisibilityTimeout": 1}),
    ],
)
def test_more_than_ten_batch_entries_are_refused(
    sqs_endpoint: str, queue: str, protocol: str, method: str, entry: dict[str, Any]
) -> None:
    client = _client(sqs_endpoint, protocol)
    with pytest.raises(ClientError) as refused:
        getattr(client, method)(QueueUrl=queue, Entries=[{"Id": str(i), **entry} for i in range(11)])
    assert _error(refused) == (
        "TooManyEntriesInBatchRequest",
        "Maximum number of entries per request are 10. You have sent 11.",
    )


def test_a_receipt_handle_stops_working_once_the_message_is_received_again(
    sqs_endpoint: str, queue: str, protocol: str
) -> None:
    client = _client(sqs_endpoint, protocol)
    client.send_message(QueueUrl=queue, MessageBody="once")
    (first,) = _receive(client, queue, visibility=0)
    (second,) = _receive(client, queue, visibility=0)
    old = first["ReceiptHandle"]
    client.delete_message(QueueUrl=queue, ReceiptHandle=old)  # succeeds ...
    response = client.delete_message_batch(QueueUrl=queue, Entries=[{"Id": "old", "ReceiptHandle": old}])
    assert [e["Id"] for e in response["Successful"]] == ["old"]
    with pytest.raises(ClientError) as refused:
        client.change_message_visibility(QueueUrl=queue, ReceiptHandle=old, VisibilityTimeout=10)
    code, message = _error(refused)
    assert code == "InvalidParameterValue"
    assert "not available for visibility timeout change" in message
    response = client.change_message_visibility_batch(
        QueueUrl=queue,
        Entries=[
            {"Id": "old", "ReceiptHandle": old, "VisibilityTimeout": 0},
            {"Id": "new", "ReceiptHandle": second["ReceiptHandle"], "VisibilityTimeout": 0},
        ],
    )
    assert [e["Id"] for e in response["Failed"]] == ["old"]
    assert [e["Id"] for e in response["Successful"]] == ["new"]
    (third,) = _receive(client, queue, visibility=30)  # ... but deleted nothing
    assert third["MessageId"] == first["MessageId"]
    client.delete_message(QueueUrl=queue, ReceiptHandle=third["ReceiptHandle"])
    assert _receive(client, queue) == []


def test_visibility_ends_at_most_12_hours_after_the_first_receive(
    sqs_endpoint: str, queue: str, protocol: str
) -> None:
    client = _client(sqs_endpoint, protocol)
    client.send_message(QueueUrl=queue, MessageBody="long")
    (message,) = _receive(client, queue, visibility=30)
    handle = message["ReceiptHandle"]
    with pytest.raises(ClientError) as refused:
        client.change_message_visibility(QueueUrl=queue, ReceiptHandle=handle, VisibilityTimeout=43_201)
    assert _error(refused)[0] == "InvalidParameterValue"
    first = time.time() - 43_000  # as if first received almost 12 hours ago
    support.backdate_first_receive(sqs_endpoint, message["MessageId"], first)
    with pytest.raises(ClientError) as refused:
        client.change_message_visibility(QueueUrl=queue, ReceiptHandle=handle, VisibilityTimeout=300)
    assert "Total VisibilityTimeout for the message is beyond the limit [43200 seconds]" in _error(refused)[1]
    response = client.change_message_visibility_batch(
        QueueUrl=queue, Entries=[{"Id": "x", "ReceiptHandle": handle, "VisibilityTimeout": 300}]
    )
    assert response["Failed"][0]["Code"] == "InvalidParameterValue"
    client.change_message_visibility(QueueUrl=queue, ReceiptHandle=handle, VisibilityTimeout=100)
    client.change_message_visibility(QueueUrl=queue, ReceiptHandle=handle, VisibilityTimeout=0)
    (again,) = _receive(client, queue, visibility=5)
    assert int(again["Attributes"]["ApproximateFirstReceiveTimestamp"]) == int(first * 1000)
