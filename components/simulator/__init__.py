"""The learned simulator: replay buffer, reasoning annotation, experience model, synthetic environment, fidelity."""
