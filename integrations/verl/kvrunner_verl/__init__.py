"""kvrunner as a verl rollout engine: ``VERL_USE_EXTERNAL_MODULES=kvrunner_verl.register``
and ``actor_rollout_ref.rollout.name=kvrunner``."""
