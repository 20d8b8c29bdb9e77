"""What the ranks of a job tell each other about snapshots (collectives and the store).

* :mod:`.agreement` -- every rank's steps (one all_gather of integers) and the step every rank
  resumes from, in memory or durably, falling back past damaged durable copies
  (``resume_from_newest_intact``, built on ``agree_across_tiers``);
* :mod:`.transfer` -- after a round forms, the newest snapshot sent to the ranks that lack it;
* :mod:`.replication` -- copies of the newest snapshot on hot spares, through the rendezvous store.

The rules (resume step, transfer plan, who keeps a replica) are pure functions in
:mod:`lightning_ft.checkpoint.policy` and :mod:`lightning_ft.checkpoint.tiers`.
"""
