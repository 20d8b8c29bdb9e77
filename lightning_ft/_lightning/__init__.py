"""Everything that knows Lightning's internals, in one place.

* :mod:`.callback_dispatch` -- keep Lightning from dispatching per-batch hooks a callback
  does not implement;
* :mod:`.callbacks` -- the typed callback lookup;
* :mod:`.trainer_reset` -- put a Trainer back into the state ``fit()`` expects after a
  failed run;
* :mod:`.checkpointing` -- the checkpoint connector and fit loop as the checkpoint callbacks
  need them (dump, restore, "is the next batch a training batch", the module being restored);
* :mod:`.compat` -- known Lightning/torch mismatches that a user's run should not see;
* :mod:`.launcher` -- the ``_Launcher`` adapter that hands ``fit()`` to the runtime's fit loop;
* :mod:`.trainer` -- device lines, device meshes, the default backend;
* :mod:`.history`, :mod:`.pristine`, :mod:`.live_state`, :mod:`.module_template`,
  :mod:`.slurm`, :mod:`.names` -- logs across recoveries, the state at ``fit()`` start, the
  step-boundary capture, the module as ``fit()`` received it, SLURM's checks, the strategy names.

The private torch names are :mod:`lightning_ft._torch`'s.

When Lightning changes, this is where to look first.
"""
