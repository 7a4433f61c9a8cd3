"""The private parts of kafka-python the pipeline touches (pipeline.kafka.internals)
are there in the installed release: a release that lacks one fails here, never
silently in a running worker, and a worker on such a release refuses to start in one
line naming what is missing."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from types import SimpleNamespace

import kafka
import kafka.errors as kerrors
import pytest
from kafka import KafkaAdminClient, KafkaConsumer
from kafka.protocol.consumer.metadata import ConsumerProtocolAssignment

from pipeline.core.errors import SetupError
from pipeline.kafka import internals, record_batches
from tests.helpers import worker_args, worker_env

# Every private part the worker relies on, as the refusal names it.
INTERNALS = (
    "_coordinator.heartbeat.last_send",
    "_coordinator.heartbeat.received_heartbeat",
    "_coordinator._process_join_group_response",
    "_coordinator._process_sync_group_response",
    "_coordinator.need_rejoin",
    "_coordinator.reset_generation",
    "_coordinator.rejoining",
    "_fetcher._paused_partition_records",
    "_fetcher._next_partition_records",
    "_fetcher.PartitionRecords",
)


def test_the_pinned_release_has_every_internal_the_pipeline_touches() -> None:
    assert kafka.__version__ == record_batches.MIRRORED_RELEASE
    # No broker is contacted until a poll: the client's parts exist from the start.
    consumer = KafkaConsumer(bootstrap_servers="127.0.0.1:1", api_version=(3, 0))
    try:
        assert internals.missing(consumer) == []
        internals.check(consumer)  # refuses nothing
        internals.track_heartbeats(consumer)
        assert not internals.heard_within(consumer, 60.0)  # no heartbeat answered yet
        assert internals.rejoining(consumer) is False  # not subscribed: no group to join
        assert internals.unpark_resumed(consumer) is False  # nothing parked
    finally:
        consumer.close(autocommit=False, timeout_ms=100)


def test_the_lease_counts_from_when_the_answered_heartbeat_was_sent() -> None:
    """A worker stopped past its session timeout reads, as it resumes, the answer to a
    heartbeat it sent before the stop, and finds the coordinator again (which resets
    kafka-python's session clock): neither renews its lease."""
    consumer = KafkaConsumer(bootstrap_servers="127.0.0.1:1", api_version=(3, 0))
    try:
        internals.track_heartbeats(consumer)
        heartbeat = consumer._coordinator.heartbeat
        heartbeat.sent_heartbeat()
        heartbeat.received_heartbeat()
        assert internals.heard_within(consumer, 1.0)
        heartbeat.sent_heartbeat()
        heartbeat.last_send = time.monotonic() - 10.0  # sent, then stopped for 10 s
        heartbeat.received_heartbeat()  # its answer read after the stop
        heartbeat.reset_timeouts()  # the coordinator found again
        assert not internals.heard_within(consumer, 4.0)
        assert internals.heard_within(consumer, 11.0)
    finally:
        consumer.close(autocommit=False, timeout_ms=100)


def test_a_completed_join_counts_from_when_its_join_group_was_sent() -> None:
    """The coordinator starts a member's session as it completes the join: a member that
    just joined may publish before its first heartbeat is answered, its lease counted
    from its JoinGroup's send; a join whose SyncGroup failed renews nothing."""

    def join(response: str, send_time: float) -> None:
        if response == "failed":
            raise kerrors.UnknownMemberIdError()

    def sync(response: str, send_time: float) -> bytes:
        if response == "failed":
            raise kerrors.RebalanceInProgressError()
        return b""

    consumer = KafkaConsumer(bootstrap_servers="127.0.0.1:1", api_version=(3, 0), group_id="g")
    try:
        coordinator = consumer._coordinator
        # kafka-python's own answers need a live group: these stand for them, answered
        # as kafka-python classifies them (return, or raise).
        coordinator._process_join_group_response = join
        coordinator._process_sync_group_response = sync
        internals.track_heartbeats(consumer)
        sent = time.monotonic() - 10.0  # a JoinGroup the coordinator held for 10 s
        coordinator._process_join_group_response("joined", sent)
        with pytest.raises(kerrors.RebalanceInProgressError):
            coordinator._process_sync_group_response("failed", time.monotonic())
        assert not internals.heard_within(consumer, 60.0)
        with pytest.raises(kerrors.UnknownMemberIdError):
            coordinator._process_join_group_response("failed", time.monotonic())
        assert not internals.heard_within(consumer, 60.0)

        coordinator._process_join_group_response("joined", sent)
        assert not internals.heard_within(consumer, 60.0)  # joined, not yet synced
        coordinator._process_sync_group_response("synced", time.monotonic())
        assert internals.heard_within(consumer, 11.0)
        assert not internals.heard_within(consumer, 9.0)  # from the send, not the answer
    finally:
        consumer.close(autocommit=False, timeout_ms=100)


class Lost(kafka.ConsumerRebalanceListener):
    def __init__(self) -> None:
        self.lost: list[set[kafka.TopicPartition]] = []

    def on_partitions_revoked(self, revoked: object) -> None:
        pass

    def on_partitions_assigned(self, assigned: object) -> None:
        pass

    def on_partitions_lost(self, lost: set[kafka.TopicPartition]) -> None:
        self.lost.append(set(lost))


def test_a_member_dropped_while_rejoining_gives_up_its_partitions_before_it_joins() -> None:
    # A stalled worker resumes, prepares to rejoin (no loss yet: its generation still
    # looks valid), and its JoinGroup is answered UnknownMemberId: the retry must not
    # claim the old partitions, and the listener must hear they were lost.
    from kafka.coordinator.base import Generation

    consumer = KafkaConsumer(bootstrap_servers="127.0.0.1:1", api_version=(3, 0), group_id="g")
    try:
        listener = Lost()
        consumer.subscribe(["t"], listener=listener)
        internals.lose_partitions_on_reset(consumer)
        coordinator = consumer._coordinator
        owned = kafka.TopicPartition("t", 0)
        consumer._subscription.assign_from_subscribed([owned])
        coordinator._generation = Generation(5, "m", "cooperative-sticky")
        coordinator.rejoining = True  # join-prepare ran for this attempt

        coordinator.reset_generation()  # what the UnknownMemberId answer does

        assert coordinator.rejoining is False  # so the retry runs join-prepare again
        asyncio.run(coordinator._on_join_prepare_async(-1, "", timeout_ms=100))
        assert listener.lost == [{owned}]
        assert consumer.assignment() == set()  # nothing claimed in the next JoinGroup
    finally:
        consumer.close(autocommit=False, timeout_ms=100)


def complete_consumer() -> SimpleNamespace:
    """Stands for a consumer with every part (the real one is the test above's)."""
    heartbeat = SimpleNamespace(last_send=0.0, received_heartbeat=lambda: None)
    return SimpleNamespace(
        _coordinator=SimpleNamespace(
            heartbeat=heartbeat,
            _process_join_group_response=lambda response, send_time: None,
            _process_sync_group_response=lambda response, send_time: b"",
            need_rejoin=lambda: False,
            reset_generation=lambda: None,
            rejoining=False,
        ),
        _fetcher=SimpleNamespace(
            _paused_partition_records={}, _next_partition_records=None, PartitionRecords=object
        ),
    )


@pytest.mark.parametrize("internal", INTERNALS)
def test_a_consumer_without_one_is_refused_in_one_line_naming_it(internal: str) -> None:
    consumer = complete_consumer()
    assert internals.missing(consumer) == []
    path, _, name = internal.rpartition(".")
    owner = consumer
    for part in path.split("."):
        owner = getattr(owner, part)
    delattr(owner, name)

    assert internals.missing(consumer) == [internal]
    with pytest.raises(SetupError) as refused:
        internals.check(consumer)
    line = str(refused.value)
    assert internal in line and "\n" not in line
    assert f"pip install kafka-python=={record_batches.MIRRORED_RELEASE}" in line
    assert SetupError.exit_code == 78


def test_a_group_error_keeps_its_class() -> None:
    """admin.describe_groups words a group's error as text; its code gives the class
    back, so that retrying can tell a coordinator loading from a missing group."""
    for error_class in (kerrors.GroupIdNotFoundError, kerrors.CoordinatorLoadInProgressError):
        worded = str(error_class("as kafka-python words it"))
        assert isinstance(internals.group_error(worded), error_class)
    assert internals.group_error(None) is None
    assert type(internals.group_error("something else")) is kerrors.KafkaError


def test_a_members_assignment_is_read_decoded_or_as_bytes() -> None:
    assignment = ConsumerProtocolAssignment(
        assigned_partitions=[("t", [2, 0]), ("u", [1])], user_data=b""
    )
    encoded = assignment.encode(version=0)
    expected = [("t", 0), ("t", 2), ("u", 1)]
    assert internals.assigned_partitions(encoded) == expected
    assert internals.assigned_partitions(ConsumerProtocolAssignment.decode(encoded)) == expected
    assert internals.assigned_partitions(b"\x00\x05not an assignment") == []
    assert internals.assigned_partitions(b"") == []


def test_the_sasl_mechanisms_client_side_is_kafka_pythons() -> None:
    configs = {
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": "u",
        "sasl_plain_password": "p",
        "security_protocol": "SASL_SSL",
    }
    plain = internals.sasl_authenticator(configs, "broker")
    assert plain.auth_bytes() == b"u\x00u\x00p" and not plain.is_done()
    plain.receive(b"")
    assert plain.is_done() and plain.is_authenticated()
    scram = internals.sasl_authenticator({**configs, "sasl_mechanism": "SCRAM-SHA-512"}, "b")
    assert scram.auth_bytes().startswith(b"n,,n=u,r=")


def test_a_first_contact_says_what_ended_it() -> None:
    contact = internals.first_contact(
        {"bootstrap_servers": ["127.0.0.1:1"], "client_id": "internals-test"}, 2_000
    )
    assert isinstance(contact.error, kerrors.KafkaConnectionError)
    assert not contact.answered and not contact.timed_out


@pytest.mark.integration
def test_a_first_contact_with_a_broker_gets_its_metadata(broker: str) -> None:
    contact = internals.first_contact({"bootstrap_servers": [broker]}, 10_000)
    assert contact == internals.Contact(None, answered=True)


def test_a_client_that_failed_to_start_leaves_no_thread() -> None:
    before = set(threading.enumerate())
    clients = internals.NetClients()
    with pytest.raises(kerrors.KafkaError):
        KafkaAdminClient(
            bootstrap_servers="127.0.0.1:1", bootstrap_timeout_ms=300, kafka_client=clients
        )
    assert clients.made
    clients.stop()
    assert set(threading.enumerate()) <= before


@pytest.mark.integration
def test_a_worker_on_a_release_without_one_refuses_to_start(
    broker: str, make_topic, tiny_model: str, tmp_path
) -> None:
    """The real worker, with kafka-python's heartbeat clock taken away at start-up
    (sitecustomize): one error line naming it, exit 78, nothing embedded."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "from kafka.coordinator.heartbeat import Heartbeat\ndel Heartbeat.received_heartbeat\n"
    )
    env = {**worker_env(broker), "PYTHONPATH": str(tmp_path / "site")}
    topic = make_topic(partitions=1)
    args = worker_args(topic, "g-internals", tmp_path / "out", "--model", tiny_model)
    result = subprocess.run([*args, "--until-end"], env=env, capture_output=True, text=True)
    assert result.returncode == SetupError.exit_code, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "_coordinator.heartbeat.received_heartbeat (the publish lease)" in line
    assert "Traceback" not in result.stderr
