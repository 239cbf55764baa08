"""Small example trainers that the job templates run and the tests use."""
