import os

import pytest
from loopback_dns import LINE, ensure_fast_loopback_reverse_lookup, has_mapped_loopback


def test_the_mapped_loopback_line_is_recognised_only_uncommented():
    assert has_mapped_loopback("127.0.0.1 localhost\n::ffff:127.0.0.1 x\n")
    assert not has_mapped_loopback("127.0.0.1 localhost\n# ::ffff:127.0.0.1 x\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="adds the line only as root")
def test_the_line_is_added_once(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost")  # no trailing newline
    assert ensure_fast_loopback_reverse_lookup(hosts) == "added"
    assert ensure_fast_loopback_reverse_lookup(hosts) == "present"
    assert hosts.read_text() == "127.0.0.1 localhost\n" + LINE
