"""Results: policies evaluated in real and simulated environments, and the results study over many runs."""
