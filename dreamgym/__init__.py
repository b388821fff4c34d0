"""The `dreamgym` command: onboarding, params, stages, flows, deployments and the results study."""
