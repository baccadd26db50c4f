"""What an operator sees of a running cluster: traces, dashboards, a terminal view."""
