"""Two torchrun "nodes" on one machine (c10d rendezvous on loopback) streaming to one recorder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddpwatch.record.recorder import load_session
from launch import QUICK_EVAL, REPO_ROOT, Recorder, free_port, python_path
from step_gate import GATED_TRAIN, StepGate


class EitherNode:
    """The two nodes' torchruns as the gate sees a run: ended once either has."""

    def __init__(self, nodes: list[subprocess.Popen[bytes]]) -> None:
        self.nodes = nodes

    def poll(self) -> int | None:
        return next((code for code in (node.poll() for node in self.nodes) if code is not None), None)


@pytest.mark.timeout(300)
def test_two_nodes_appear_with_their_node_and_a_switch_reaches_both(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=python_path())  # the gated worker imports gate_files
    gate = StepGate(tmp_path / "gate")  # the run waits for the test's steps: it cannot end before the switch lands
    nodes: list[subprocess.Popen[bytes]] = []
    with Recorder(tmp_path / "session", "--idle-exit", "30") as recorder:
        try:
            for node_rank in (0, 1):
                log = open(tmp_path / f"node{node_rank}.log", "wb")
                nodes.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=1",
                     "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", "--rdzv_id=ddpwatch-test",
                     str(GATED_TRAIN), str(gate.path), *QUICK_EVAL, "--strategy", "simple", "--steps", "20", "--batch-size", "8",
                     "--log-every", "5", "--watch", recorder.address],
                    cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            either = EitherNode(nodes)
            gate.step_through(2, either)
            ack = gate.switch(recorder.address, "bucket", 1.0, None, either, last_step=18, timeout_s=60)
            gate.allow(20)
            assert ack.applied
            for node in nodes:
                assert node.wait(240) == 0, "".join(p.read_text()[-2000:] for p in tmp_path.glob("node*.log"))
        finally:
            for node in nodes:
                if node.poll() is None:
                    os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        recorder.wait()
    session = load_session(tmp_path / "session" / "session.ddpwatch")
    assert {state.hello.node_rank for state in session.ranks.values()} == {0, 1}
    after = [r for step, ranks in session.reports.items() if step >= ack.step for r in ranks.values()]
    assert {r.rank for r in after} == {0, 1} and {r.strategy for r in after} == {"bucket"}
    strategies = [s["strategy"] for s in json.loads((tmp_path / "session" / "summary.json").read_text())["segments"]]
    assert strategies == ["simple", "bucket"]
