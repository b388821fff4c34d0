"""Throughput of a served simulator bundle against the same bundle in process, side by side in one run.

    .venv/bin/python benchmarks/simulator_server.py BUNDLE [--clients 1 4 16] [--steps 48] [--threads 2]

`BUNDLE` is a directory made by `dreamgym simulator export`. The in-process row plays `--steps` steps through
`gym_env.SimulatorEnv` (one episode at a time, one model call per step). Each served row starts
`dreamgym simulator serve` on 127.0.0.1 and lets N WebSocket clients play `--steps` steps between them, each episode
reset after it ends; the server batches the steps that arrive while the model answers. Transitions per second are
wall clock over the steps played (first steps included), and the ratio is to the in-process row.
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import print_machine, table  # noqa: E402

ACTIONS = ("look", "inventory", "open fridge", "take knife", "go north")


def in_process(bundle: Path, steps: int) -> float:
    from components.simulator.gym_env import SimulatorEnv

    env = SimulatorEnv(bundle)
    env.reset(seed=0)
    env.step(ACTIONS[0])  # load the model and buffer before the clock starts, as a running server has
    env.reset(seed=0)
    started = time.monotonic()
    for step in range(steps):
        _, _, terminated, truncated, _ = env.step(ACTIONS[step % len(ACTIONS)])
        if terminated or truncated:
            env.reset(seed=step)
    return steps / (time.monotonic() - started)


def served(bundle: Path, clients: int, steps: int) -> tuple[float, float]:
    """Transitions per second over `clients` sessions, and the mean batch the server made."""
    from websockets.sync.client import connect

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_file = Path(f"/tmp/simulator_server_{port}.log")  # why a server did not start
    with log_file.open("w") as log_output:
        server = subprocess.Popen([sys.executable, "-m", "dreamgym.cli", "simulator", "serve", str(bundle), "--port",
                                   str(port), "--max-sessions", str(clients)], stdout=log_output,
                                  stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=1)
                break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"the server did not start: see {log_file}") from None
                time.sleep(0.2)

        def play(client: int, quota: int) -> None:
            with connect(f"ws://127.0.0.1:{port}/ws") as connection:
                def ask(message: dict) -> dict:
                    connection.send(json.dumps(message))
                    return json.loads(connection.recv(timeout=600))["data"]
                ask({"type": "reset", "data": {"seed": client}})
                for step in range(quota):
                    if ask({"type": "step", "data": {"message": ACTIONS[step % len(ACTIONS)]}})["done"]:
                        ask({"type": "reset", "data": {"seed": client * 1000 + step}})

        play(0, 1)  # warm: the server loads the model and the buffer on its first step
        warm = json.loads(urllib.request.urlopen(f"{base}/health").read())
        quotas = [steps // clients + (i < steps % clients) for i in range(clients)]
        started = time.monotonic()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(play, range(clients), quotas))
        seconds = time.monotonic() - started
        health = json.loads(urllib.request.urlopen(f"{base}/health").read())
        batches = health["batches"] - warm["batches"]
        return steps / seconds, (health["steps"] - warm["steps"]) / max(1, batches)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print_machine(args.threads)
    baseline = in_process(args.bundle, args.steps)
    rows = [["in process (gymnasium)", "1", f"{baseline:.2f}", "1.00", "1"]]
    for clients in args.clients:
        rate, batch = served(args.bundle, clients, args.steps)
        rows.append(["served", str(clients), f"{rate:.2f}", f"{rate / baseline:.2f}", f"{batch:.1f}"])
        print(rows[-1], flush=True)
    print(table(["how", "clients", "transitions/s", "ratio to in process", "mean batch"], rows))


if __name__ == "__main__":
    main()
