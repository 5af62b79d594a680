"""Who may talk to a run: loopback by default; beyond it, only holders of the CURVE client key."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from ddpwatch.ingest.curve_server import ensure_keys
from ddpwatch.ingest.receiver import TelemetryReceiver
from ddpwatch.control.switch_client import request_switch
from instrumented_ddp.wire.codec import encode
from instrumented_ddp.wire.messages import Hello
from instrumented_ddp.wire.curve_keys import load_client_keys
from launch import REPO_ROOT, Recorder, free_port
from step_gate import StepGate, start_gated_ranks


def test_listening_beyond_loopback_without_keys_is_refused() -> None:
    with pytest.raises(OSError, match="needs authentication"):
        TelemetryReceiver(f"tcp://0.0.0.0:{free_port()}")


def test_train_refuses_a_remote_dashboard_without_a_key() -> None:
    result = subprocess.run([sys.executable, str(REPO_ROOT / "train.py"), "--watch", "tcp://192.0.2.1:5555"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "is not loopback: pass --watch-key FILE" in result.stderr.strip().splitlines()[-1]


def test_keys_are_made_once_and_readable_only_by_their_user(tmp_path: Path) -> None:
    keys, client_file = ensure_keys(tmp_path / "keys")
    again, _ = ensure_keys(tmp_path / "keys")
    assert keys == again
    for name in ("server.json", "client.json"):
        assert stat.S_IMODE((tmp_path / "keys" / name).stat().st_mode) == 0o600
    assert "server_secret" not in json.loads(client_file.read_text())
    assert load_client_keys(str(client_file)).client_public == keys.client_public


@pytest.mark.timeout(300)
def test_rogue_sender_and_controller_are_rejected_while_the_real_run_goes_on(tmp_path: Path) -> None:
    _, client_file = ensure_keys(tmp_path / "keys")
    _, rogue_client_file = ensure_keys(tmp_path / "rogue-keys")  # a key pair the dashboard never made
    with Recorder(tmp_path / "session", "--keys", str(tmp_path / "keys"), "--idle-exit", "30", bind_host="0.0.0.0") as recorder:
        gate = StepGate(tmp_path / "gate")  # the run waits for the test's steps: it cannot end before the switch lands
        training = start_gated_ranks(gate, ["--strategy", "simple", "--steps", "20", "--batch-size", "8", "--log-every", "10",
                                            "--watch", recorder.address, "--watch-key", str(client_file)], tmp_path / "train.log")
        context = zmq.Context()
        try:
            rogue = context.socket(zmq.DEALER)  # no keys at all
            rogue.setsockopt(zmq.LINGER, 0)
            rogue.connect(recorder.address)
            rogue.send(encode(Hello(0, 2, "spoofed", "evil", 1, "cpu", "gloo", "simple", {}, 1)), zmq.NOBLOCK)
            # Its handshake refused, the command is never delivered (a relay that took it would
            # answer, if only that it gave it up, at 1 s + ACK_GRACE_S).
            with pytest.raises(TimeoutError, match="^nothing answered at"):
                request_switch(recorder.address, "ddp", None, None, timeout_s=1, keys=load_client_keys(str(rogue_client_file)))
            # The real switch once the run has stepped on `simple` (a switch sent earlier waits for
            # rank 0 and lands on step 1, leaving no `simple` segment).
            gate.step_through(1, training)
            try:
                ack = gate.switch(recorder.address, "bucket", 1.0, None, training, last_step=18, timeout_s=60,
                                  keys=load_client_keys(str(client_file)))
            except TimeoutError:
                training.stop()
                pytest.fail(f"no acknowledgement; training said:\n{(tmp_path / 'train.log').read_text()[-3000:]}")
            gate.allow(20)
            assert ack.applied
            assert training.wait(timeout=240) == 0, (tmp_path / "train.log").read_text()[-3000:]
        finally:
            context.destroy(linger=0)
            training.stop()
        recorder.wait()
    summary = json.loads((tmp_path / "session" / "summary.json").read_text())
    assert summary["session"] != "spoofed"
    assert [s["strategy"] for s in summary["segments"]] == ["simple", "bucket"]  # the rogue's ddp never happened
    assert summary["telemetry"]["rejected"].get("unauthenticated", 0) >= 2
