from django.db import models


class Order(models.Model):
    """An order: `unpaid` until paid, `closed` when its 15 minutes ran out first."""

    amount = models.DecimalField(max_digits=10, decimal_places=2)
    status = models.CharField(max_length=16, default="unpaid")
    created_at = models.DateTimeField(auto_now_add=True)
