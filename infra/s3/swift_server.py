"""Run one Swift server script (swift-*-server CONF [options]) with swift.conf from the store's own directory.

Swift reads the hash prefix/suffix and the storage policies from /etc/swift/swift.conf whatever a server's
`swift_dir` says (swift_dir only locates the rings). That file belongs to the system: on Debian it is the
package's sample, on a machine running a real Swift it is that cluster's, and a change to it would move or
break every object of the local store. Pointing Swift at the store's swift.conf first keeps the store
self-contained.
usage: swift_server.py SWIFT_DIR SERVER_SCRIPT CONF [options]
"""
import runpy
import sys

from swift.common import utils

swift_dir, script, *args = sys.argv[1:]
utils.set_swift_dir(swift_dir)  # also re-reads the hash prefix/suffix from SWIFT_DIR/swift.conf

# These read swift.conf when first imported; reload in case something imported them before the switch.
from swift.common import constraints, storage_policy  # noqa: E402

constraints.reload_constraints()
storage_policy.reload_storage_policies()

sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
