"""The build half of specstore (Apache Beam). Importing it quiets Lance's per-write
"No existing dataset ... it will be created" warnings, in this process and in the Beam workers
it starts (they inherit the environment); an explicit LANCE_LOG setting wins."""

import os

os.environ.setdefault("LANCE_LOG", "error")
