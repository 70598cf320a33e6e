"""The flight recorder: its records, their one schema, the writer and the sinks."""
