"""The ``ddpwatch`` command: every subcommand parses here and runs elsewhere."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from instrumented_ddp.wire.one_line_errors import OneLineErrorParser
from instrumented_ddp.wire.output_paths import directory_problem, file_in_the_way
from instrumented_ddp.wire.codec import DEFAULT_MAX_MESSAGE_BYTES
from instrumented_ddp.wire.messages import bucket_mb_problem
from instrumented_ddp.wire.kinds import STRATEGY_NAMES
from instrumented_ddp.wire.endpoints import DEFAULT_ADDRESS

from ddpwatch.control.relay import ACK_GRACE_S

if TYPE_CHECKING:
    from instrumented_ddp.wire.curve_keys import ServerKeys
    from ddpwatch.dashboard.app import DashboardApp
    from ddpwatch.export.live_outputs import LiveOutputs


def with_example(command_line: str) -> dict[str, Any]:
    """A parser's keywords that end its ``--help`` with ``command_line``, one example of the
    command, printed as written."""
    return {"epilog": f"example:\n  {command_line}", "formatter_class": argparse.RawDescriptionHelpFormatter}


class PrintVersion(argparse.Action):
    """``--version``: ``ddpwatch <version>`` from the installed package's metadata, exit 0. Read
    only when asked, so that no other command pays for the lookup."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        from importlib.metadata import version

        print(f"ddpwatch {version('ddpwatch')}")  # on stdout, as argparse's own version action
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="ddpwatch", description="Watch PyTorch data-parallel training, rank by rank. With no COMMAND: the live dashboard.",
        **with_example("ddpwatch --out runs/live --listen tcp://127.0.0.1:5555"))
    parser.add_argument("--version", action=PrintVersion, help="print ddpwatch's version and exit")
    parser.add_argument("--listen", default=DEFAULT_ADDRESS, help=f"address to listen on (default {DEFAULT_ADDRESS})")
    parser.add_argument("--out", type=Path, help="session directory (default ddpwatch-sessions/<time>)")
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                        help=f"larger messages are rejected and counted (default {DEFAULT_MAX_MESSAGE_BYTES:,})")
    parser.add_argument("--keys", type=Path, help="CURVE key directory (made if missing); needed beyond loopback")
    parser.add_argument("--memory-budget", type=positive_gib, metavar="GIB", help="GiB a rank may hold at its peak, for the "
                        "Advisor tab's strategy table and tune --strategies (default: the device's memory)")
    add_listener_outputs(parser)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    replay = commands.add_parser("replay", help="play a recorded session through the dashboard",
                                 **with_example("ddpwatch replay runs/live --speed 4"))
    replay.add_argument("session", type=Path, help="a session directory (or its session file)")
    replay.add_argument("--speed", type=float, default=1.0, help="times the recorded pace (0: as fast as possible)")
    # Here too, where a user looks for it, as well as before the command (``ddpwatch --out DIR replay
    # SESSION``); SUPPRESS keeps this parser's default from overwriting the one given there.
    replay.add_argument("--out", type=Path, default=argparse.SUPPRESS,
                        help="where `e` and quitting write the exports (default: none, the recording's own are kept)")

    demo = commands.add_parser("demo", help="the dashboard plus a 2-process CPU training run it starts itself",
                               **with_example("ddpwatch demo --nproc 4 --strategy bucket"))
    demo.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    demo.add_argument("--nproc", type=int, default=2, help="ranks, on this machine's CPU (default 2)")
    demo.add_argument("--strategy", default="simple", help=f"the strategy it starts with: {', '.join(STRATEGY_NAMES)} (default simple)")
    demo.add_argument("--out", type=Path, default=argparse.SUPPRESS, help="session directory (default ddpwatch-sessions/<time>)")

    record = commands.add_parser("record", help="record a session headless and write its summary when it ends",
                                 **with_example("ddpwatch record --out runs/async --until-steps 200"))
    # SUPPRESS on the flags the top level has too: a subcommand's default must not overwrite the
    # value given before the command (``ddpwatch --listen tcp://HOST:PORT record``).
    record.add_argument("--listen", default=argparse.SUPPRESS, help=f"address to listen on (default {DEFAULT_ADDRESS})")
    # Required (``needs_out``), but not by argparse: ``ddpwatch --out DIR record`` gives it before the command.
    record.add_argument("--out", type=Path, default=argparse.SUPPRESS, help="directory for the session file and exports (required)")
    record.add_argument("--until-steps", type=int, help="stop once every rank reported this step")
    record.add_argument("--until-seconds", type=float, help="stop after this long")
    record.add_argument("--idle-exit", type=float, default=15.0, help="stop when every rank is silent this long")
    record.add_argument("--runs", type=int, default=1, metavar="N",
                        help="record N runs one after another (a script that trains more than once: a Trainer's train() "
                        "called again, hyperparameter_search's trials); each earlier run's exports go in a folder named "
                        "after it (default 1: stop when the first run's ranks have all said goodbye)")
    record.add_argument("--wait", type=float, help="give up, exit 2, when no rank has connected this many seconds after "
                        "start (default: wait as long as it takes; --idle-exit counts only once a rank has spoken)")
    record.add_argument("--max-message-bytes", type=int, default=argparse.SUPPRESS,
                        help=f"larger messages are rejected and counted (default {DEFAULT_MAX_MESSAGE_BYTES:,})")
    record.add_argument("--keys", type=Path, default=argparse.SUPPRESS, help="CURVE key directory (made if missing); needed beyond loopback")
    record.add_argument("--sample", type=int, metavar="N", help="ask the ranks for the spans of every N-th step only "
                        "(summaries of the rest: figures exact, timelines sampled); default: every span")
    add_listener_outputs(record, argparse.SUPPRESS)

    switch = commands.add_parser("switch", help="ask a running session to switch strategy (through the dashboard or recorder)",
                                 **with_example("ddpwatch switch bucket --bucket-mb 4"))
    switch.add_argument("strategy", help=", ".join(STRATEGY_NAMES))
    switch.add_argument("--bucket-mb", type=float, help="the bucket cap, MB (bucket, ddp, zero1, zero2)")
    switch.add_argument("--grad-accum", type=int, help="micro-steps per optimizer step")
    switch.add_argument("--listen", default=argparse.SUPPRESS, help=f"the address the dashboard or recorder listens on (default {DEFAULT_ADDRESS})")
    switch.add_argument("--timeout", type=float, default=30.0,
                        help="seconds the run has to apply it (default 30): past them rank 0 refuses it, never applies it "
                             f"later; the answer is waited for {ACK_GRACE_S + 1:g} s more")
    switch.add_argument("--key", help="CURVE client keys (client.json) of a dashboard beyond loopback")

    tune = commands.add_parser("tune", help="sweep bucket caps on a running job with live switches: the advisor's "
                                            "predictions against the measured step times",
                               **with_example("ddpwatch tune --out runs/tune --sizes 1,4,25"))
    tune.add_argument("--listen", default=argparse.SUPPRESS, help=f"address to listen on, as for record (default {DEFAULT_ADDRESS})")
    tune.add_argument("--out", type=Path, default=argparse.SUPPRESS, help="directory for the session file, exports and tune.json (required)")
    tune.add_argument("--sizes", type=bucket_sizes, help="caps in MB, comma-separated (default: the predicted best and its neighbours)")
    tune.add_argument("--steps-per-size", type=int, default=10, help="counted steps measured at each cap (at least 2)")
    tune.add_argument("--strategy", default="bucket", choices=["bucket", "ddp"], help="what to switch to at each cap")
    tune.add_argument("--strategies", type=strategy_list, help="sweep these strategies instead of caps, comma-separated "
                      "(e.g. ddp,zero1,zero2,fsdp): each predicted, switched to and measured")
    tune.add_argument("--grad-accum", type=accumulation_list, default=[1], help="with --strategies: micro-steps to try "
                      "each at, comma-separated (default 1)")
    tune.add_argument("--memory-budget", type=positive_gib, metavar="GIB", default=argparse.SUPPRESS,
                      help="with --strategies: GiB a rank may hold at its peak (default: the device's memory)")
    tune.add_argument("--wait", type=float, default=120.0, help="seconds to wait for a run to connect")
    tune.add_argument("--idle-exit", type=float, default=30.0, help="stop when every rank is silent this long")
    tune.add_argument("--keys", type=Path, default=argparse.SUPPRESS, help="CURVE key directory (made if missing); needed beyond loopback")
    add_listener_outputs(tune, argparse.SUPPRESS)
    doctor = commands.add_parser("doctor", help="check ddpwatch's GPU figures on this machine against torch.profiler, NVML, overhead",
                                 **with_example("ddpwatch doctor --ranks 2 --keep doctor-runs"))
    doctor.add_argument("--strategies", default="bucket,ddp", help="strategies of the profiled runs (comma-separated)")
    doctor.add_argument("--overhead-steps", type=int, default=20, help="timed steps per mode in the overhead checks (0: none)")
    doctor.add_argument("--ranks", type=int, help="ranks of the profiled runs (default: one per GPU, at most 2); "
                        "more than the GPUs share them, to see collectives on a one-GPU machine")
    doctor.add_argument("--keep", type=Path, help="keep each run's session and profiler traces here")

    summary = commands.add_parser("summary", help="print the comparison table of a recorded session",
                                  **with_example("ddpwatch summary runs/async"))
    summary.add_argument("session", type=Path, help="a session directory (or its session file)")

    compare = commands.add_parser("compare", help="recorded runs side by side, each segment against the first "
                                                  "(what a change bought, run twice)",
                                  **with_example("ddpwatch compare runs/25mb runs/small --fail-if-slower 5"))
    compare.add_argument("sessions", type=Path, nargs="+", metavar="SESSION",
                         help="session directories (or session files); two runs or more in all, the first the baseline")
    compare.add_argument("--fail-if-slower", type=float, metavar="PCT",
                         help="exit 1 where a segment's step time p50 is more than PCT %% above the baseline's and "
                              "their 90 %% intervals are apart (a regression check for CI)")
    return parser


def add_listener_outputs(parser: argparse.ArgumentParser, default: Any = None) -> None:
    """The flags of what a listener feeds as it receives (``export.live_outputs``), on the top
    level and again on ``record`` and ``tune`` (there ``default`` is SUPPRESS: see ``--listen``)."""
    parser.add_argument("--prometheus", metavar="HOST:PORT", default=default,
                        help="serve the per-rank figures at http://HOST:PORT/metrics for Prometheus to scrape")
    parser.add_argument("--prometheus-linger", type=float, metavar="S", default=0.0 if default is None else default,
                        help="with record or tune: keep /metrics up this long after the recording ends, serving its "
                        "final figures (default 0)")
    parser.add_argument("--tensorboard", type=Path, metavar="DIR", default=default,
                        help="write each step's and segment's figures as TensorBoard scalars, a run folder per session")
    parser.add_argument("--wandb", action="store_true", default=False if default is None else default,
                        help="log each step's and segment's figures to a W&B run (WANDB_MODE=offline: no network)")
    parser.add_argument("--wandb-project", metavar="NAME", default=default,
                        help="the W&B project (default WANDB_PROJECT, else ddpwatch)")
    parser.add_argument("--wandb-run", metavar="NAME", default=default, help="the W&B run's name (default WANDB_NAME, "
                        "else the session's id)")


#: The options of the top level (``ddpwatch --listen ADDRESS COMMAND``), in the order they are named.
TOP_LEVEL_OPTIONS = ("listen", "out", "max_message_bytes", "keys", "memory_budget", "prometheus", "prometheus_linger",
                     "tensorboard", "wandb", "wandb_project", "wandb_run")
#: Those each command reads; one it does not read, given, is refused, not ignored: ``ddpwatch
#: --listen ADDRESS demo`` would otherwise listen elsewhere without a word.
READS = {"dashboard": set(TOP_LEVEL_OPTIONS) - {"prometheus_linger"}, "record": set(TOP_LEVEL_OPTIONS) - {"memory_budget"},
         "tune": set(TOP_LEVEL_OPTIONS),
         "switch": {"listen"}, "replay": {"out", "memory_budget"}, "demo": {"out"}, "doctor": set(), "summary": set(), "compare": set()}


def refuse_unread_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A ``ValueError`` naming the first top-level option given that ``args.command`` does not read."""
    command = args.command or "dashboard"
    for name in TOP_LEVEL_OPTIONS:
        if name not in READS[command] and getattr(args, name, None) != parser.get_default(name):
            option = "--" + name.replace("_", "-")
            raise ValueError(f"{option} does nothing for {command}: it is not one of its options "
                             f"(`ddpwatch {command} --help` lists them)")


#: The commands that cannot run without ``--out``, given before the command or after it.
NEEDS_OUT = {"record": "the session file and exports", "tune": "the session file, exports and tune.json"}


def needs_out(args: argparse.Namespace) -> None:
    """A ``ValueError`` where ``args.command`` needs ``--out`` and it was given nowhere. Not
    argparse's ``required=True`` on the command's own ``--out``: that refuses ``ddpwatch --out DIR
    record``, the option given but before the command."""
    if args.command in NEEDS_OUT and args.out is None:
        raise ValueError(f"--out DIR is required: the directory for {NEEDS_OUT[args.command]}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        refuse_unread_options(args, parser)
        needs_out(args)
        return COMMANDS[args.command or "dashboard"](args)
    except BrokenPipeError:  # the reader went away (``ddpwatch summary DIR | head``): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not raise again
        return 0
    except (OSError, ValueError, TimeoutError) as error:
        print(f"ddpwatch{' ' + args.command if args.command else ''}: error: {error}", file=sys.stderr)
        return 2


def writable_out_dir(path: Path, flag: str = "--out") -> Path:
    """``--out``, made now, or refused in one line: a directory that cannot be made would fail
    unseen later (the dashboard's receiver process cannot open its session file and ends, and no
    rank can connect)."""
    if problem := directory_problem(flag, str(path)):
        raise ValueError(problem)
    return path


def session_file_to_read(given: Path) -> Path:
    """The session file ``given`` names (its directory or the file itself), refused in one line
    where there is none or it holds no ddpwatch message (``replay`` and ``summary``)."""
    from ddpwatch.ingest.session_file import not_a_session_file, session_file_in

    path = session_file_in(given)
    if not path.is_file():
        raise ValueError(f"{given} holds no session file")
    if problem := not_a_session_file(path):
        raise ValueError(problem)
    return path


def default_session_dir() -> Path:
    import time

    return Path("ddpwatch-sessions") / time.strftime("%Y%m%d-%H%M%S")


def server_keys(args: argparse.Namespace) -> ServerKeys | None:  # ServerKeys imported lazily (zmq's CURVE)
    """The CURVE keys to listen with (made on first use), telling the user where the client file is."""
    if args.keys is None:
        return None
    if (in_the_way := file_in_the_way(args.keys)) is not None:  # else mkdir's bare "[Errno 17] File exists"
        raise ValueError(f"--keys {args.keys}: {in_the_way} (the key directory, made if missing)")
    from ddpwatch.ingest.curve_server import ensure_keys

    keys, client_file = ensure_keys(args.keys)
    print(f"ddpwatch: CURVE on; give the training nodes {client_file} (train.py --watch-key {client_file})", file=sys.stderr)
    return keys


def listener_outputs(args: argparse.Namespace, command: str, out_dir: Path) -> LiveOutputs:
    """What ``args`` asks the listener to feed, each started now: a port taken, a missing extra
    or a W&B that cannot start is one line, exit 2, before anything listens (what was started
    is closed again)."""
    from ddpwatch.export.live_outputs import ListenerOutput, LiveOutputs

    if not args.prometheus_linger >= 0:
        raise ValueError("--prometheus-linger must be 0 or more seconds")
    if (args.wandb_project or args.wandb_run) and not args.wandb:
        raise ValueError("--wandb-project and --wandb-run name the run --wandb logs to: give --wandb too")
    if args.tensorboard is not None and (problem := directory_problem("--tensorboard", str(args.tensorboard))):
        raise ValueError(problem)
    outputs: list[ListenerOutput] = []
    try:
        if args.prometheus is not None:
            from ddpwatch.export.prometheus_endpoint import PrometheusEndpoint

            endpoint = PrometheusEndpoint(args.prometheus)
            outputs.append(endpoint)
            print(f"{command}: Prometheus metrics at {endpoint.url}", file=sys.stderr, flush=True)
        if args.tensorboard is not None:
            from ddpwatch.export.tensorboard_scalars import TensorBoardScalars

            outputs.append(TensorBoardScalars(args.tensorboard))
        if args.wandb:
            from ddpwatch.export.wandb_scalars import WandbScalars

            outputs.append(WandbScalars(args.wandb_project, args.wandb_run, out_dir))
    except ImportError as missing:  # the extra's line: "--tensorboard needs the tensorboard extra: pip install ..."
        LiveOutputs(outputs).close()
        raise ValueError(str(missing)) from None
    except OSError:
        LiveOutputs(outputs).close()
        raise
    return LiveOutputs(outputs)


def linger_then_close(outputs: LiveOutputs, args: argparse.Namespace) -> None:
    """``--prometheus-linger``: /metrics stays up serving the final figures, then every output closes."""
    import time

    if args.prometheus is not None and args.prometheus_linger > 0 and outputs:
        try:
            time.sleep(args.prometheus_linger)
        except KeyboardInterrupt:  # Ctrl-C ends the lingering, not with a traceback
            pass
    outputs.close()


def run_dashboard(args: argparse.Namespace) -> int:
    from ddpwatch.dashboard.app import DashboardApp
    from ddpwatch.dashboard.process_feed import ProcessFeed
    from ddpwatch.ingest.session_file import SESSION_FILE_NAME

    positive(args, "max_message_bytes")
    out_dir = writable_out_dir(args.out or default_session_dir())
    outputs = listener_outputs(args, "ddpwatch", out_dir)
    feed = ProcessFeed(args.listen, out_dir / SESSION_FILE_NAME, args.max_message_bytes, server_keys(args))
    app = DashboardApp(feed, out_dir, memory_budget_mib=args.memory_budget * 1024 if args.memory_budget else None,
                       outputs=outputs)
    try:
        app.run()
    finally:
        outputs.close()
    print(f"session recorded in {out_dir}")
    return exports_failed(app)


def exports_failed(app: DashboardApp, command: str = "ddpwatch") -> int:
    """1, with the reason, where the dashboard could not write its exports (it stayed open)."""
    if app.export_failure is None:
        return 0
    print(f"{command}: error: {app.export_failure}", file=sys.stderr)
    return 1


def run_replay(args: argparse.Namespace) -> int:
    from ddpwatch.dashboard.app import DashboardApp
    from ddpwatch.dashboard.feeds import ReplayFeed

    if not (math.isfinite(args.speed) and args.speed >= 0):  # inf and nan too: the replay's clock runs at it
        raise ValueError("--speed must be 0 (as fast as possible) or a positive, finite number")
    path = session_file_to_read(args.session)
    out_dir = writable_out_dir(args.out) if args.out is not None else None
    app = DashboardApp(ReplayFeed(path, args.speed), out_dir, export_on_exit=out_dir is not None,
                       memory_budget_mib=args.memory_budget * 1024 if args.memory_budget else None)
    app.run()
    return exports_failed(app, "ddpwatch replay")


def run_demo(args: argparse.Namespace) -> int:
    from ddpwatch.dashboard.app import DashboardApp
    from ddpwatch.dashboard.process_feed import ProcessFeed
    from ddpwatch.demo import free_loopback_address, report_if_training_fails, start_training, stop_training
    from ddpwatch.ingest.session_file import SESSION_FILE_NAME

    if args.steps < 1 or args.nproc < 1:
        raise ValueError("--steps and --nproc must be at least 1")
    if args.strategy not in STRATEGY_NAMES:  # train.py would refuse it, unseen, behind a dashboard waiting for it
        raise ValueError(f"unknown strategy {args.strategy!r}; choose one of {', '.join(STRATEGY_NAMES)}")
    out_dir = writable_out_dir(args.out or default_session_dir())
    address = free_loopback_address()
    training = start_training(address, out_dir / "train.log", args.nproc, args.steps, args.strategy)
    failure: list[str] = []
    try:
        feed = ProcessFeed(address, out_dir / SESSION_FILE_NAME)  # ZeroMQ's threads start in its child process
        app = DashboardApp(feed, out_dir)

        def report(line: str) -> None:
            failure.append(line)
            app.hold_warning(line)  # from the waiting thread, even before the app runs: see hold_warning

        report_if_training_fails(training, report)
        app.run()
    finally:
        stop_training(training)
    print(f"session recorded in {out_dir} (training output in {out_dir / 'train.log'})")
    if failure:
        print(f"ddpwatch demo: error: {failure[0]}", file=sys.stderr)
        return 1
    return exports_failed(app, "ddpwatch demo")


def run_record(args: argparse.Namespace) -> int:
    import time

    from ddpwatch.record.recorder import StopRule, record

    positive(args, "until_steps", "until_seconds", "sample", "wait", "idle_exit", "max_message_bytes", "runs")
    started = time.monotonic()
    out_dir = writable_out_dir(args.out)
    outputs = listener_outputs(args, "ddpwatch record", out_dir)
    try:
        session = record(args.listen, out_dir, StopRule(args.until_steps, args.until_seconds, args.idle_exit, args.wait),
                         args.max_message_bytes, keys=server_keys(args), sample_every=args.sample, runs=args.runs,
                         outputs=outputs)
    finally:
        linger_then_close(outputs, args)
    if args.wait is not None and not session.messages and time.monotonic() - started >= args.wait:  # not a Ctrl-C before it
        print(f"ddpwatch record: error: no rank connected within {args.wait:g} s" if not session.rejected else
              f"ddpwatch record: error: every message was rejected ({sum(session.rejected.values())}: "
              f"{', '.join(f'{n} {kind}' for kind, n in sorted(session.rejected.items()))})", file=sys.stderr)
        return 2
    return 0


def positive(args: argparse.Namespace, *flags: str) -> None:
    """Each of ``flags`` given must be above 0 (``not > 0`` refuses nan too; inf means no limit)."""
    for flag in flags:
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive")


def summaries_at(path: Path) -> list[dict]:
    """Every run's summary at ``path``, oldest first: its exports where written (an earlier run's
    in a folder named after it), else made from its session file."""
    from ddpwatch.export.exporters import summary
    from ddpwatch.record.recorder import load_runs
    from ddpwatch.ingest.session_file import session_file_in

    if (path / "summary.json").is_file():
        return [json.loads(file.read_text()) for file in [*sorted(path.glob("*/summary.json")), path / "summary.json"]]
    if session_file_in(path).is_file():
        return [summary(run) for run in load_runs(session_file_to_read(path))]
    raise ValueError(f"{path} holds no summary.json and no session file")


def run_summary(args: argparse.Namespace) -> int:
    """Every run's table, oldest first: a dashboard left open records a script run twice (or a
    Trainer's second ``train()``) in one session file, and writes each earlier run's exports in a
    folder named after it beside the last one's."""
    from ddpwatch.export.exporters import summary_markdown

    print("\n\n".join(summary_markdown(data) for data in summaries_at(args.session)))
    return 0


def run_compare(args: argparse.Namespace) -> int:
    """Each run of each session given, named by its path (and its session id where a path holds
    several), in the order given; the first segment is the baseline. With ``--fail-if-slower``,
    exit 1 where a later segment is slower than allowed (``comparison.slower_than_allowed``)."""
    from ddpwatch.export.comparison import comparison_lines, slower_than_allowed

    allowed = args.fail_if_slower
    if allowed is not None and not (math.isfinite(allowed) and allowed >= 0):
        raise ValueError(f"--fail-if-slower must be a percentage, 0 or more, not {allowed:g}")
    runs = []
    for path in args.sessions:
        found = summaries_at(path)
        runs += [(str(path) if len(found) == 1 else f"{path} ({data.get('session') or index})", data)
                 for index, data in enumerate(found)]
    if len(runs) < 2:
        raise ValueError(f"compare needs two runs or more: {args.sessions[0]} holds one (give another session)")
    print("\n".join(comparison_lines(runs)))
    if allowed is None:
        return 0
    slower = slower_than_allowed(runs, allowed)
    for line in slower:
        print(f"ddpwatch compare: {line}", file=sys.stderr)
    return 1 if slower else 0


def run_doctor(args: argparse.Namespace) -> int:
    from ddpwatch.doctor.checkup import doctor

    strategies = [name.strip() for name in args.strategies.split(",") if name.strip()]
    if not strategies or any(name not in STRATEGY_NAMES for name in strategies):
        raise ValueError(f"--strategies takes names from {', '.join(STRATEGY_NAMES)}, not {args.strategies!r}")
    if args.overhead_steps != 0 and args.overhead_steps < 4:
        raise ValueError("--overhead-steps must be 0 (no overhead runs) or at least 4")
    if args.ranks is not None and not 1 <= args.ranks <= 8:
        raise ValueError(f"--ranks must be 1 to 8, not {args.ranks}")
    if args.keep is not None:  # before the minutes of runs that write there
        writable_out_dir(args.keep, "--keep")
    try:
        return doctor(strategies, args.overhead_steps, args.keep, args.ranks)
    except RuntimeError as error:  # the probe or a run failed outright
        print(f"ddpwatch doctor: error: {error}", file=sys.stderr)
        return 2


def bucket_sizes(text: str) -> list[float]:
    """``--sizes``: positive megabytes, comma-separated."""
    try:
        sizes = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of MB") from None
    if not sizes or any(bucket_mb_problem(size) for size in sizes):  # inf too: no rank could take it
        raise argparse.ArgumentTypeError("every cap must be a positive, finite number of MB")
    return sizes


def strategy_list(text: str) -> list[str]:
    """``--strategies``: known strategy names, comma-separated."""
    from ddpwatch.advisor.strategy_sim import STRATEGIES

    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in STRATEGIES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown strategy {', '.join(unknown) or repr(text)}: one of {', '.join(STRATEGIES)}")
    return names


def accumulation_list(text: str) -> list[int]:
    """``--grad-accum``: micro-step counts of 1 or more, comma-separated."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not counts or any(k < 1 for k in counts):
        raise argparse.ArgumentTypeError("every micro-step count must be 1 or more")
    return counts


def positive_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError("the memory budget must be a positive number of GiB")
    return value


def run_tune(args: argparse.Namespace) -> int:
    from ddpwatch.advisor.tune import SweepDriver, table, write_results

    if args.steps_per_size < 2:
        print("ddpwatch tune: error: --steps-per-size must be at least 2", file=sys.stderr)
        return 2
    positive(args, "wait", "idle_exit")
    if args.strategies:
        return run_strategy_tune(args)
    if args.grad_accum != [1]:
        print("ddpwatch tune: error: --grad-accum goes with --strategies", file=sys.stderr)
        return 2
    driver = SweepDriver(args.strategy, args.steps_per_size, args.sizes, connect_timeout_s=args.wait)
    record_the_sweep(args, driver)
    if driver.failure:
        print(f"ddpwatch tune: error: {driver.failure}", file=sys.stderr)
        return 2
    write_results(args.out, driver.results, driver.start_mb)
    print("\n".join(table(driver.results, driver.start_mb)))
    if unmeasured := driver.unmeasured():  # the table alone leaves them out without a word
        print(f"ddpwatch tune: not measured: {', '.join(f'{mb:.3g}' for mb in unmeasured)} MB: the run ended or went "
              f"silent first; give it more steps (each cap takes {args.steps_per_size} counted steps after its switch, "
              "--steps-per-size)", file=sys.stderr)
        return 1
    return 0 if len(driver.results) > 1 else 1


def record_the_sweep(args: argparse.Namespace, driver: Any) -> None:
    """``tune``'s recording, ``driver`` switching the run through it, with what the listener feeds."""
    from ddpwatch.record.recorder import StopRule, record

    out_dir = writable_out_dir(args.out)
    outputs = listener_outputs(args, "ddpwatch tune", out_dir)
    try:
        record(args.listen, out_dir, StopRule(idle_exit_s=args.idle_exit), args.max_message_bytes,
               keys=server_keys(args), drive=driver, command="ddpwatch tune", outputs=outputs)
    finally:
        linger_then_close(outputs, args)


def run_strategy_tune(args: argparse.Namespace) -> int:
    """``tune --strategies``: the strategy sweep (``strategy_tune``)."""
    from ddpwatch.advisor.strategy_tune import StrategySweep, strategy_table, write_strategy_results

    if args.sizes:
        print("ddpwatch tune: error: --sizes sweeps caps; --strategies sweeps strategies: give one", file=sys.stderr)
        return 2
    budget = args.memory_budget * 1024 if args.memory_budget is not None else None
    driver = StrategySweep(args.strategies, args.grad_accum, args.steps_per_size, budget, connect_timeout_s=args.wait)
    record_the_sweep(args, driver)
    if driver.failure:
        print(f"ddpwatch tune: error: {driver.failure}", file=sys.stderr)
        return 2
    write_strategy_results(args.out, driver.results)
    print("\n".join(strategy_table(driver.results)))
    asked = len(args.strategies) * len(args.grad_accum)
    if len(driver.results) < asked:
        print(f"ddpwatch tune: measured {len(driver.results)} of {asked} choices: the run ended or went silent first; "
              f"give it more steps (each takes {args.steps_per_size} counted steps after its switch)", file=sys.stderr)
        return 1
    return 0


def run_switch(args: argparse.Namespace) -> int:
    from ddpwatch.control.switch_client import request_switch

    from instrumented_ddp.wire.curve_keys import load_client_keys

    if not (math.isfinite(args.timeout) and args.timeout > 0):  # inf breaks the poll's int(); nan and 0 give up at once
        raise ValueError("--timeout must be a positive, finite number of seconds")
    keys = load_client_keys(args.key) if args.key else None
    ack = request_switch(args.listen, args.strategy, args.bucket_mb, args.grad_accum, args.timeout, keys)
    if not ack.applied:
        print(f"ddpwatch switch: error: not applied: {ack.detail}", file=sys.stderr)
        return 1
    print(f"switched to {args.strategy} at step {ack.step}" + (f" ({ack.detail})" if ack.detail else ""))
    return 0


COMMANDS = {"dashboard": run_dashboard, "record": run_record, "summary": run_summary, "switch": run_switch, "tune": run_tune,
            "replay": run_replay, "demo": run_demo, "doctor": run_doctor, "compare": run_compare}

if __name__ == "__main__":
    sys.exit(main())
