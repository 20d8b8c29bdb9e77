"""One configuration model: settings dataclasses whose fields document themselves, one loader.

* :mod:`.fields` -- :func:`~.fields.setting` declares a setting once (default, doc, rule,
  environment variable); :func:`~.fields.load` builds settings from keyword arguments and the
  environment; :func:`~.fields.describe` lists them.
* :mod:`.environment` -- the one module that reads the process environment: the loader's input,
  the run id and failure domain every entry point resolves alike, the scheduler's facts.
* :mod:`.timeouts` -- :class:`~.timeouts.Timeouts`: every bounded wait, one named field each.

Each component declares its own settings class next to its code (``rendezvous/settings.py``,
``runtime/settings.py``, ``checkpoint/settings.py``, ``termination/settings.py``,
``health/settings.py``); this package imports none of them.
"""

from lightning_ft.settings.fields import SettingInfo, SettingsError, describe, group, load, setting
from lightning_ft.settings.timeouts import DEFAULT_TIMEOUTS, Timeouts

__all__ = ["DEFAULT_TIMEOUTS", "SettingInfo", "SettingsError", "Timeouts", "describe", "group", "load", "setting"]
