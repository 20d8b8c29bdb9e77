"""Stragglers: each rank's own work per step, who is persistently slow, and what to do about it.

:mod:`.policy` decides on plain numbers; :mod:`.meter` measures a rank's own work (time not
spent waiting for its peers); :mod:`.watch` shares the measurements through the round's store
and carries out what the policy decides (the strategy's round watchdog drives it).
"""
