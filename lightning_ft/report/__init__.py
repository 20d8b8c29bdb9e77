"""``lightning-ft report``: a run's timeline, lost time and goodput from its event log
(:mod:`.timeline`), and the stragglers' part (:mod:`.work`). Pure reading; no Lightning, no torch."""
