"""Everything that knows Lightning's internals, in one place.

* :mod:`.registration` -- register ``ddp_ft`` with Lightning's ``StrategyRegistry`` whenever
  ``lightning.pytorch`` loads (this package itself imports no Lightning);
* :mod:`.callback_dispatch` -- keep Lightning from dispatching per-batch hooks a callback
  does not implement;
* :mod:`.callbacks` -- the typed callback lookup;
* :mod:`.trainer_reset` -- put a Trainer back into the state ``fit()`` expects after a
  failed run;
* :mod:`.checkpointing` -- the checkpoint connector and fit loop as the checkpoint callbacks
  need them (dump, restore, "is the next batch a training batch", the module being restored);
* :mod:`.compat` -- known Lightning/torch mismatches that a user's run should not see.

When Lightning changes, this is where to look first.
"""
