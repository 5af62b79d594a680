"""One widget a file; each draws a part of a ``Snapshot`` and posts messages up."""
