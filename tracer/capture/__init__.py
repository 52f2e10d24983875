"""The capture file: ``files`` writes it without ever blocking the tap (and rotates
it) and reads it back, validating every record; ``bodies`` keeps request bodies compact
(shared prefixes) and bounds what the observers hold."""
