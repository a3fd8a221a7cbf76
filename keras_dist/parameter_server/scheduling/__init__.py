"""The coordinator's side: functions traced into programs and scheduled onto the workers."""
