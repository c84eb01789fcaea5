"""Project exceptions. A SpecstoreError is a user-facing problem: the CLI prints its message as
one line and exits non-zero, without a traceback."""


class SpecstoreError(Exception):
    """Base class for errors caused by input, configuration or stored data."""


class DatastoreNotFoundError(SpecstoreError):
    """Unknown store, datastore name, version or tag."""


class ManifestMismatchError(SpecstoreError):
    """The datastore was built for another model or tokenizer; the message names the field."""

    def __init__(self, field: str, expected: object, actual: object):
        self.field = field
        super().__init__(
            f"datastore manifest field '{field}' does not match: datastore has {expected!r}, given {actual!r}"
        )


class ChecksumError(SpecstoreError):
    """A file of a datastore version is missing or does not match its manifest checksum."""
