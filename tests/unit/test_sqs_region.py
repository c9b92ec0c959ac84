"""The SQS client's region: ``AWS_REGION`` first (as the AWS SDKs and the AWS CLI v2 read it),
then boto3's own chain (``AWS_DEFAULT_REGION``, the profile's ``region``).

boto3 alone ignores ``AWS_REGION``: the quickstart's ``export AWS_REGION=eu-west-1`` made
``provision`` say "set AWS_REGION", and with a profile in ``~/.aws/config`` the queues landed
in the profile's region without a word.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sqla_outbox import errors
from sqla_outbox.config import OutboxSettings
from sqla_outbox.sqs.client import make_client

AWS_ONLY = OutboxSettings()  # no endpoint URL: real AWS, where a missing region is an error


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An environment with no region anywhere; returns the config file a test may fill."""
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "config"
    config.write_text("", encoding="utf-8")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    return config


def test_aws_region_wins_over_the_profile_and_aws_default_region(
    aws_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    aws_env.write_text("[default]\nregion = us-west-2\n", encoding="utf-8")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    assert make_client(AWS_ONLY).meta.region_name == "eu-west-1"


def test_without_aws_region_boto3s_chain_decides(aws_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    aws_env.write_text("[default]\nregion = us-west-2\n", encoding="utf-8")
    assert make_client(AWS_ONLY).meta.region_name == "us-west-2"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    assert make_client(AWS_ONLY).meta.region_name == "ap-south-1"


def test_no_region_for_real_aws_names_the_variable(aws_env: Path) -> None:
    with pytest.raises(errors.ConfigurationError, match="set AWS_REGION"):
        make_client(AWS_ONLY)
    endpoint = OutboxSettings(sqs_endpoint_url="http://127.0.0.1:9")  # an emulator: us-east-1
    assert make_client(endpoint).meta.region_name == "us-east-1"
