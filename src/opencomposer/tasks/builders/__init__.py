"""Task builders: feature deletion and bug injection from code with passing tests."""
