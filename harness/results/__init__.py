"""Results: the typed record of a results line, results files, derived figures,
reports, plots, JUnit XML."""
