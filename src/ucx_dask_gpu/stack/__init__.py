"""stack.toml, typed: the model every consumer reads (`load()`), the hash-pinned Python lock it names, and the files
generated from it. Standard library only: the UCX build imports it with a bare python3."""
from .model import (BUILD_DETECTED_FLAGS, SHA256_RE, STACK_ENV, STACK_ID_FILE, Artifact, SbomSpec, SourceArchive,
                    Stack, StackError, find_stack_file, load, parse)
