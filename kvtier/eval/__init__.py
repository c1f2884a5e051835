"""The evaluation harness behind `kvtier eval` and `kvtier report`: tasks, policies, runs, reports."""
