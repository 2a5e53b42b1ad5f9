"""A client nobody in this project wrote: Stripe's own Python SDK (stripe 16.1.0), for
tests/tests/http_stripe.rs. It creates one charge against the test server and prints, as one
JSON line, the charge or the error it ended with.

Usage: charge.py BASE_URL AMOUNT [IDEMPOTENCY_KEY]

Without a key the SDK makes one (a UUID) and sends it on every retry of the request, as it does
against api.stripe.com. Retries are the SDK's own: max_network_retries=2 (Stripe's documented
default), on a lost connection, 409 and 5xx, with its own back-off, unless the response says
Stripe-Should-Retry: false.
"""

import json
import sys

import stripe


def main():
    base, amount = sys.argv[1], int(sys.argv[2])
    options = {"idempotency_key": sys.argv[3]} if len(sys.argv) > 3 else {}
    client = stripe.StripeClient("sk_test_idempotent", base_addresses={"api": base}, max_network_retries=2)
    try:
        charge = client.v1.charges.create(params={"amount": amount, "currency": "eur"}, options=options)
        print(json.dumps({"charge": charge.id, "amount": charge.amount}))
    except stripe.StripeError as error:
        print(json.dumps({"error": type(error).__name__, "status": error.http_status}))


if __name__ == "__main__":
    main()
