"""Run one episode of a policy in an environment and record it as a contract Trajectory."""
from __future__ import annotations

from components.data.contract import Step, Task, Trajectory
from components.envs.base import Environment, EnvironmentFailure, Policy, failed_reset


def run_episode(env: Environment, task: Task, policy: Policy, *, max_steps: int, trajectory_id: str,
                source: str) -> Trajectory:
    """Reset, act until done or `max_steps`; a truncated episode ends with done false on its last step.

    A reset the environment fails (`EnvironmentFailure`) gives a one-step episode marked as such (`failed_reset`),
    as a step it fails does: either way `env_failure(trajectory)` says why.
    """
    try:
        observation = env.reset(task)
    except EnvironmentFailure as error:
        return Trajectory(trajectory_id, task, [failed_reset(str(error))], False, 0.0, source)
    history: list[tuple[str, str]] = []
    steps: list[Step] = []
    success = False
    for _ in range(max_steps):
        action = policy(task, observation, history)
        result = env.step(action)
        steps.append(Step(observation.state, action, result.observation.state, result.reward, result.done,
                          {k: v for k, v in result.info.items() if k != "success"}))
        history.append((observation.state, action))
        observation = result.observation
        if result.done:
            success = bool(result.info.get("success", False))
            break
    return Trajectory(trajectory_id, task, steps, success, sum(step.reward for step in steps), source)
