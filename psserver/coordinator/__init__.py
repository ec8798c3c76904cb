"""The leader's coordination: membership, admission, the schedule of epochs and steps, the end of a
job."""
