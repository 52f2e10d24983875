"""The attribution scenario matrix (issue 23): cases recorded once from real processes."""
