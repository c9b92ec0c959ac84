"""SQS access shared by the relay, the worker and the operations commands.

The application side never imports this package (nor boto3): it only writes rows.
"""
