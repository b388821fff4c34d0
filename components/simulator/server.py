"""A synthetic environment served to many rollout workers over OpenEnv's wire protocol (as openenv-core 0.3.0 speaks
it): a simulator bundle's (`create_app`, `dreamgym simulator serve`), or the RL stage's own, which its processes play
in under a launcher (`shared_simulators`; `rollouts.RemoteSyntheticBatch` is the client).

Each WebSocket connection to `/ws` is one session with its own episode: the client sends
`{"type": "reset", "data": {"seed": 0, "task_id": ...}}` (or `"task"`: a whole task record),
`{"type": "step", "data": {"message": "open fridge"}}`, `{"type": "state"}` (the episode so far, with its
trajectory record) or `{"type": "close"}`, and gets `{"type": "observation", "data": {"observation": {...},
"reward": r, "done": d}}`, `{"type": "state", "data": {...}}` or `{"type": "error", "data": {"message", "code"}}`.
The observation carries the text (`text`), the task, and what `gym_env.SimulatorEnv` puts in `info` (fallback,
retrieved examples' ids, truncation at the turn limit, success once done), and `env_failure`: why the episode ended
without an outcome (the model's fallback ends it), else null. OpenEnv's `GenericEnvClient(base_url=...)`
is a client.

Steps of all sessions are batched: while the experience model answers one batch, the steps that arrive wait, and go
together in the next `SyntheticEnvironment.step_batch` (one retrieval and one model call for all). At most
`max_sessions` sessions run at once: one more is refused on connect with the code CAPACITY_REACHED. `GET /health`,
`GET /schema` and `GET /metadata` answer as OpenEnv's do; `POST /reset` (stateless, as OpenEnv's) returns a first
observation. With `shadow` (a share), that share of the sessions' episodes is replayed in the real environment as
they end (`shadow.Shadow`); `GET /shadow` and the log say how far the two agree. The app holds no ML logic of its
own: the environment does the work.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, HTTPException, WebSocket, WebSocketDisconnect

from components import distributed
from components.data.contract import Task
from components.envs.base import ENV_FAILURE
from components.simulator.synthetic import record_trajectory

if TYPE_CHECKING:  # create_app imports them: the RL stages, which serve no bundle, do not depend on them
    from components.simulator.bundle import Bundle
    from components.simulator.shadow import Shadow

log = logging.getLogger(__name__)


@dataclass
class Session:
    episode: Any = None  # synthetic.SyntheticEpisode, once reset
    ended: bool = False  # the episode has been offered to the shadow replay (once per episode)
    rng: random.Random = field(default_factory=random.Random)
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)


class StepBatcher:
    """Queues the sessions' steps; one worker sends whatever is queued to the simulator as one batch."""

    def __init__(self, simulator: Any, max_batch: int) -> None:
        self.simulator, self.max_batch = simulator, max_batch
        self.queue: asyncio.Queue = asyncio.Queue()
        self.batches = self.steps = 0

    async def step(self, episode: Any, action: str) -> Any:
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((episode, action, future))
        return await future

    async def run(self) -> None:
        while True:
            items = [await self.queue.get()]
            while not self.queue.empty() and len(items) < self.max_batch:
                items.append(self.queue.get_nowait())
            try:
                results = await asyncio.to_thread(self.simulator.step_batch, [e for e, _, _ in items],
                                                  [a for _, a, _ in items])
                self.batches, self.steps = self.batches + 1, self.steps + len(items)
                for (_, _, future), result in zip(items, results, strict=True):
                    if not future.done():  # its client went away meanwhile
                        future.set_result(result)
            except asyncio.CancelledError:
                raise
            except BaseException as error:  # the batch's sessions each get it; the worker goes on with the next
                log.exception("a batch of %d steps failed", len(items))
                for _, _, future in items:
                    if not future.done():
                        future.set_exception(error if isinstance(error, Exception) else RuntimeError(str(error)))


def create_app(bundle: Bundle | str | Path, *, environment: str | None = None, max_sessions: int = 64,
               max_batch: int = 64, backend: str | None = None, cache_dir: str | Path | None = None,
               shadow: float = 0.0) -> FastAPI:
    """The server app of `bundle` (a path or a loaded bundle) for one of its environments; `shadow`: the share of
    episodes replayed in the real environment (0: none)."""
    from components.simulator.bundle import Bundle, load_bundle
    from components.simulator.shadow import Shadow

    bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    simulator = bundle.environment(environment, backend=backend, cache_dir=cache_dir)
    shadowing = Shadow(*bundle.real_environment(simulator.name), shadow) if shadow else None
    return simulator_app(simulator, lambda rng, task_id: bundle.choose_task(simulator.name, rng, task_id),
                         bundle.truncated, version=str(bundle.manifest["format"]), max_sessions=max_sessions,
                         max_batch=max_batch, shadowing=shadowing)


def simulator_app(simulator: Any, choose_task: Callable[[random.Random, str | None], Task],
                  truncated: Callable[[Any], bool] = lambda episode: False, *, version: str = "",
                  max_sessions: int = 64, max_batch: int = 64, shadowing: Shadow | None = None) -> FastAPI:
    """The server app of a synthetic environment (`synthetic.SyntheticEnvironment`): a reset plays the task its
    message gives whole (`data.task`), else `choose_task(session's rng, data.task_id)`; `truncated(episode)` ends an
    episode at a turn limit."""
    name = simulator.name
    batcher = StepBatcher(simulator, max_batch)
    sessions: dict[str, Session] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker = asyncio.create_task(batcher.run())
        try:
            yield
        finally:  # clean shutdown: the worker stops, sessions are dropped, queued shadow replays finish
            worker.cancel()
            sessions.clear()
            if shadowing is not None:
                await asyncio.to_thread(shadowing.close)

    app = FastAPI(title=f"dreamgym simulator: {name}", lifespan=lifespan)
    app.state.batcher, app.state.sessions = batcher, sessions

    def end_episode(session: Session) -> None:
        """Offer a played episode (finished, or left unfinished by a reset or a disconnect) to the shadow replay,
        once; an episode without a step (a stateless `POST /reset`, say) is not one the share counts."""
        episode = session.episode
        if shadowing is None or episode is None or not episode.steps or session.ended:
            return
        session.ended = True
        if shadowing.wants_next():
            shadowing.submit(record_trajectory(episode))

    def first_observation(session: Session, data: dict[str, Any]) -> dict[str, Any]:
        if data.get("seed") is not None:
            session.rng.seed(data["seed"])
        # a whole task: one the server need not know (a curriculum's variation, a user's own)
        task = Task.from_dict(data["task"]) if data.get("task") is not None else \
            choose_task(session.rng, data.get("task_id"))
        end_episode(session)
        session.episode, session.ended = simulator.new_episode(task), False
        return {"observation": {"text": session.episode.state, "task_id": task.task_id,
                                "instruction": task.instruction, "truncated": False, "fallback": False,
                                "env_failure": None,
                                "retrieved": [], "reasoning": ""}, "reward": None, "done": False}

    async def next_observation(session: Session, action: str) -> dict[str, Any]:
        if session.episode is None or session.episode.done:
            raise RuntimeError("the episode is over or was never started: send a reset")
        result = await batcher.step(session.episode, action)
        ended_by_limit = truncated(session.episode)
        if session.episode.done:
            end_episode(session)
        failure = result.info.get(ENV_FAILURE)  # the model's fallback ended the episode: why
        return {"observation": {"text": result.observation.state, "task_id": session.episode.task.task_id,
                                "instruction": session.episode.task.instruction,
                                "truncated": ended_by_limit or failure is not None,
                                "fallback": result.info["fallback"], "env_failure": failure,
                                "retrieved": result.info.get("retrieved", []),
                                "reasoning": result.info.get("reasoning", ""),
                                "success": result.info.get("success")},  # the environment's verdict, when done
                "reward": float(result.reward), "done": bool(result.done or ended_by_limit)}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "healthy", "active_sessions": len(sessions), "max_sessions": max_sessions,
                "batches": batcher.batches, "steps": batcher.steps,
                "shadow": {"share": shadowing.share, "replayed": len(shadowing.real),
                           "failed": shadowing.failed_replays, "pending": shadowing.pending}
                if shadowing is not None else None}

    @app.get("/shadow")
    async def shadow_agreement() -> dict[str, Any]:
        if shadowing is None:
            raise HTTPException(status_code=404, detail="shadow mode is off: serve with --shadow SHARE")
        return await asyncio.to_thread(shadowing.summary)

    @app.get("/metadata")
    async def metadata() -> dict[str, Any]:
        return {"name": f"dreamgym-{name}", "description": "a DreamGym experience model simulating " + name,
                "version": version, "readme_content": None, "author": None,
                "documentation_url": None}

    @app.get("/schema")
    async def schema() -> dict[str, Any]:
        text = {"type": "string"}
        return {"action": {"type": "object", "properties": {"message": text}, "required": ["message"]},
                "observation": {"type": "object", "properties": {
                    "text": text, "task_id": text, "instruction": text, "truncated": {"type": "boolean"},
                    "fallback": {"type": "boolean"}, "env_failure": {"type": ["string", "null"]},
                    "retrieved": {"type": "array", "items": text},
                    "reasoning": text, "success": {"type": ["boolean", "null"]}}},
                "state": {"type": "object", "properties": {"episode_id": text, "step_count": {"type": "integer"},
                                                           "task_id": text, "trajectory": {"type": "object"}}}}

    @app.post("/reset")
    async def reset(data: dict[str, Any]) -> dict[str, Any]:
        try:
            return first_observation(Session(), data)
        except (LookupError, TypeError, ValueError) as error:
            raise HTTPException(status_code=422, detail=str(error)) from error

    @app.websocket("/ws")
    async def session_channel(websocket: WebSocket) -> None:
        await websocket.accept()
        if len(sessions) >= max_sessions:
            await websocket.send_json({"type": "error", "data": {
                "message": f"Server at capacity: {len(sessions)}/{max_sessions} sessions active. Cannot accept new "
                           "connections.", "code": "CAPACITY_REACHED", "active_sessions": len(sessions),
                "max_sessions": max_sessions}})
            await websocket.close()
            return
        session = Session()
        sessions[session.session_id] = session
        try:
            while True:
                try:
                    message = json.loads(await websocket.receive_text())
                    kind, data = message.get("type"), message.get("data") or {}
                    if not isinstance(data, dict):
                        raise ValueError
                except (ValueError, AttributeError, KeyError, TypeError):  # bad JSON, not an object, a binary frame
                    await websocket.send_json({"type": "error", "data": {
                        "message": 'not a JSON object {"type": ..., "data": {...}}', "code": "INVALID_JSON"}})
                    continue
                try:
                    if kind == "reset":
                        reply = {"type": "observation", "data": first_observation(session, data)}
                    elif kind == "step":
                        if not isinstance(data.get("message"), str):
                            reply = {"type": "error", "data": {"message": "a step's data needs a string `message` "
                                                               "(the action)", "code": "VALIDATION_ERROR"}}
                        else:
                            reply = {"type": "observation",
                                     "data": await next_observation(session, data["message"])}
                    elif kind == "state":
                        episode = session.episode
                        reply = {"type": "state", "data": {
                            "episode_id": episode.trajectory_id if episode else None,
                            "step_count": len(episode.steps) if episode else 0,
                            "task_id": episode.task.task_id if episode else None,
                            # the episode so far as a contract trajectory (what an RL client keeps)
                            "trajectory": record_trajectory(episode).to_dict() if episode else None}}
                    elif kind == "close":
                        break
                    else:
                        reply = {"type": "error", "data": {"message": f"unknown message type {kind!r}",
                                                           "code": "UNKNOWN_TYPE"}}
                except Exception as error:  # this session's request failed: it hears why, the others go on
                    reply = {"type": "error", "data": {"message": f"{type(error).__name__}: {error}",
                                                       "code": "EXECUTION_ERROR"}}
                await websocket.send_json(reply)
        except WebSocketDisconnect:
            pass
        finally:
            sessions.pop(session.session_id, None)
            end_episode(session)
        await _close_quietly(websocket)

    return app


async def _close_quietly(websocket: WebSocket) -> None:
    try:
        await websocket.close()
    except RuntimeError:  # already closed by the client
        pass


@contextmanager
def serving(app: FastAPI, host: str = "127.0.0.1") -> Iterator[str]:
    """`app` served from a thread of this process on a free port of `host`; yields its base URL, stops it after."""
    import socket
    import threading
    import time

    import uvicorn

    listener = socket.socket()
    listener.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws_max_size=2 ** 26))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True, name="simulator")
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the simulator server on {host} did not start (see the log above)")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        listener.close()


@contextmanager
def shared_simulators(environments: Sequence[Any], sessions: int) -> Iterator[dict[str, str] | None]:
    """Under a launcher: the main process serves each of its synthetic `environments` (on 127.0.0.1, `sessions`
    episodes at once, their steps batched into one experience-model call) and every process gets the servers' URLs,
    {environment name: URL}, to play its episodes in; the servers stop once every process is done. One process:
    None (episodes step in the process, no server)."""
    if distributed.world_size() == 1:
        yield None
        return
    with ExitStack() as servers:
        apps = {env.name: simulator_app(env, _tasks_come_whole, max_sessions=sessions, max_batch=sessions)
                for env in environments} if distributed.is_main_process() else {}
        urls = distributed.broadcast({name: servers.enter_context(serving(app)) for name, app in apps.items()})
        yield urls
        distributed.wait_for_everyone()  # the last episodes are played before the servers stop
        for name, app in apps.items():  # the main process's: how well the processes' steps were batched
            batcher = app.state.batcher
            log.info("simulator server for %s (%s): %d steps of %d processes in %d experience-model calls", name,
                     urls[name], batcher.steps, distributed.world_size(), batcher.batches)


def _tasks_come_whole(rng: random.Random, task_id: str | None) -> Task:
    raise LookupError("this simulator server plays the tasks its clients send: reset with data.task")


def serve(bundle: str | Path, *, host: str, port: int, **settings: Any) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM end it cleanly)."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")  # shadow's reports
    uvicorn.run(create_app(bundle, **settings), host=host, port=port, log_level="info")
