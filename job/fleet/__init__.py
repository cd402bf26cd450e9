"""The fleet: the processes of a job and how the driver reaches them. ``lifecycle`` starts and stops them (Ray, the
trainer ranks, the engine, the rollout workers), ``placement`` decides where each runs, ``trainer_ranks`` is the
trainer ranks as the driver calls them, ``rollout_workers`` spreads episodes over the workers, and ``weight_sync``
carries new weights from rank 0 to the engine."""
