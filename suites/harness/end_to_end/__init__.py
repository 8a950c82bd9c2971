"""End-to-end tests across the harness: the installed wheel, CI workflows, process hygiene,
hostile and broken plug-ins, malformed input."""
