"""Placing and paying orders: each in one transaction with its task."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

from django.db import transaction
from django.http import HttpRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from keyexpiry.django.compat import task_backends
from orders.models import Order
from orders.tasks import close_unpaid

PAY_WITHIN = dt.timedelta(minutes=15)


@csrf_exempt  # an API endpoint of the example; a real shop authenticates its clients
@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    """POST /orders/ amount=19.90: the order and its timeout commit together, or neither."""
    with transaction.atomic():
        order = Order.objects.create(amount=Decimal(request.POST["amount"]))
        close_unpaid.using(run_after=timezone.now() + PAY_WITHIN).enqueue(order.id)
    return JsonResponse({"id": order.id, "status": order.status}, status=201)


@csrf_exempt
@require_POST
def pay(request: HttpRequest, order_id: int) -> JsonResponse:
    """POST /orders/<id>/pay: paid, and its timeout cancelled in the same transaction."""
    with transaction.atomic():
        paid = Order.objects.filter(id=order_id, status="unpaid").update(status="paid")
        if paid:
            task_backends["default"].cancel_task(close_unpaid, order_id)
    order = Order.objects.get(id=order_id)
    return JsonResponse({"id": order.id, "status": order.status}, status=200 if paid else 409)
