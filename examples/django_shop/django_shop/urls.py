"""The shop's URLs: orders, the admin (with the ledger) and keyexpiry's dashboard for staff."""

from django.contrib import admin
from django.urls import include, path
from orders import views

urlpatterns = [
    path("orders/", views.place_order, name="place_order"),
    path("orders/<int:order_id>/pay", views.pay, name="pay"),
    path("admin/", admin.site.urls),
    path("keyexpiry/", include("keyexpiry.django.urls")),
]
