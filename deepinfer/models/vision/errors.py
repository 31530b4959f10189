"""The one error an image request can get: a ValueError whose message is one line naming the image, what was
wrong and what is allowed (a server turns it into a 400)."""


class ImageInputError(ValueError):
    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
